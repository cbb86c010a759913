-- Why this migration exists: ids made in the same millisecond sorted at random, because the 12 bits
-- after the version nibble were random. Claims take groups by id, so two groups submitted within
-- one millisecond could be claimed out of submission order (and a test comparing ids sorted with
-- submission order failed about one run in six). Those 12 bits now hold the fraction of the
-- millisecond (RFC 9562 §6.2, method 3: clock_timestamp's microseconds scaled to 0..4095), so ids
-- made in different microseconds sort by time. On a live database: one function replaced, its
-- grants kept; existing ids stay as they are.
CREATE OR REPLACE FUNCTION trainq.uuidv7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
  SELECT encode(
    overlay(uuid_send(gen_random_uuid())
            -- bytes 1–6: Unix milliseconds; bytes 7–8: version 7 (0x7000) + the 12-bit fraction
            PLACING substring(int8send(floor(ms)::bigint) FROM 3)
                    || int2send((28672 + floor((ms - floor(ms)) * 4096))::int2)
            FROM 1 FOR 8),
    'hex')::uuid
  FROM (SELECT extract(epoch FROM clock_timestamp()) * 1000 AS ms) AS now
$$;
COMMENT ON FUNCTION trainq.uuidv7() IS
  'A time-ordered version-7 UUID (48-bit Unix milliseconds, 12 bits of sub-millisecond fraction, random bits); the default id of trainq.groups.';
