-- Why this migration exists: what the database accepts, the worker must be able to use (issue 13).
-- Producers could store groups that crashed the worker at decode time or poisoned a whole batch,
-- and some limits measured the wrong thing. The insert trigger now also refuses, with a stable
-- SQLSTATE naming the row, trajectory and field:
--   * JSON numbers beyond a double (|x| > 1.7976931348623157e308) anywhere in a group (TQ020): the
--     worker decodes with serde_json, which refuses them;
--   * values nested more than 64 levels deep in `trajectories` or `metadata` (TQ021), well below
--     serde_json's recursion limit of 128;
--   * token ids at or beyond the model's vocabulary (TQ022), now stored on the model row
--     (`models.vocab_size`, read from the base model's config.json by `trainq model create`;
--     NULL = unknown, not checked here, the worker still skips such a group `invalid`);
--   * rewards whose statistics a double cannot hold: beyond ±1e100, or nonzero below 1e-100 in
--     magnitude (TQ005, as for NaN and infinities), instead of a bare 22003 from the std.
-- The payload limit (TQ017) now measures the uncompressed jsonb size: a value read from another
-- table (INSERT … SELECT, the COPY-into-a-temporary-table route) arrives compressed, and
-- pg_column_size() of it was its compressed size. Every refusal of a row that is not the first
-- of its statement starts with "row N: ", and every refusal carries DETAIL "row N of the
-- statement", so a multi-row INSERT or COPY says which row it refused.
-- On a live database: one nullable column, one statement trigger, replaced function bodies. The
-- tables are locked up front in the order every writer takes them (groups, then models), so a
-- producer or a commit in flight cannot deadlock with the migration, and lock_timeout bounds how
-- long submissions and claims queue behind it (run `trainq migrate` again if it times out).

SET LOCAL lock_timeout = '10s';
LOCK TABLE trainq.groups, trainq.models IN ACCESS EXCLUSIVE MODE;

ALTER TABLE trainq.models
    ADD COLUMN vocab_size integer,
    ADD CONSTRAINT models_vocab_size_positive CHECK (vocab_size > 0);
COMMENT ON COLUMN trainq.models.vocab_size IS
  'Token ids of this model lie in [0, vocab_size) (config.json "vocab_size" of the base); larger ids are refused on insert '
  '(SQLSTATE TQ022). NULL: unknown, not checked on insert (the worker skips such a group invalid).';
COMMENT ON COLUMN trainq.groups.payload_bytes IS
  'Uncompressed jsonb size of trajectories in bytes, computed on insert (limit: models.max_group_bytes, TQ017).';
COMMENT ON COLUMN trainq.models.max_group_bytes IS
  'Largest uncompressed jsonb size in bytes of one group''s trajectories (SQLSTATE TQ017 beyond).';

-- Raises a trainq validation error with a fixed SQLSTATE; during an INSERT or COPY into
-- trainq.groups it names the row (trainq.insert_row, counted by the triggers below).
CREATE OR REPLACE FUNCTION trainq.refuse(code text, message text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  row_number integer := CASE WHEN code LIKE 'TQ0%'
                             THEN nullif(current_setting('trainq.insert_row', true), '')::integer END;
BEGIN
  IF row_number IS NULL OR row_number < 1 THEN
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message;
  END IF;
  RAISE EXCEPTION USING ERRCODE = code,
    MESSAGE = CASE WHEN row_number > 1 THEN format('row %s: %s', row_number, message) ELSE message END,
    DETAIL = format('row %s of the statement (counting from 1)', row_number);
END $$;

-- BEFORE INSERT statement trigger: starts the row count of trainq.refuse's messages.
-- (Assignments, not PERFORM: PL/pgSQL evaluates a simple expression without a query.)
CREATE FUNCTION trainq.start_row_count() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
  counted text;
BEGIN
  counted := set_config('trainq.insert_row', '0', true);
  RETURN NULL;
END $$;
REVOKE EXECUTE ON FUNCTION trainq.start_row_count() FROM PUBLIC;

CREATE TRIGGER groups_count_rows BEFORE INSERT ON trainq.groups
  FOR EACH STATEMENT EXECUTE FUNCTION trainq.start_row_count();

-- The first place in `value` (a path like "metrics.score" or "messages[2].token_ids", empty for
-- the value itself) that breaks the JSON limits: a number beyond a double, or a value nested
-- more than `max_level` levels below `value`. No row when there is none. Breadth first, and it
-- stops at the first find; only groups the fast path flags are walked.
CREATE FUNCTION trainq.json_limit_violation(value jsonb, max_level integer)
RETURNS TABLE (too_deep boolean, path text)
LANGUAGE sql IMMUTABLE AS $$
  WITH RECURSIVE walk (path, v, level) AS (
      SELECT ''::text, value, 0
    UNION ALL
      SELECT w.path || c.step, c.v, w.level + 1
      FROM walk w
      CROSS JOIN LATERAL (
          SELECT '.' || e.key AS step, e.value AS v
          FROM jsonb_each(CASE WHEN jsonb_typeof(w.v) = 'object' THEN w.v END) e
        UNION ALL
          SELECT format('[%s]', a.o - 1), a.x
          FROM jsonb_array_elements(CASE WHEN jsonb_typeof(w.v) = 'array' THEN w.v END) WITH ORDINALITY a (x, o)
      ) c
      WHERE w.level <= max_level
  )
  SELECT level > max_level, ltrim(path, '.')
  FROM walk
  WHERE level > max_level OR (jsonb_typeof(v) = 'number' AND abs(v::numeric) > 1.7976931348623157e308)
  LIMIT 1
$$;

-- Refuses `value` (field `field`, at location `at`: 'trajectory 2' or '') if it breaks the JSON limits.
CREATE FUNCTION trainq.check_json_limits(at text, field text, value jsonb, max_level integer) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  bad record;
  name text;
  prefix text := CASE WHEN at = '' THEN '' ELSE at || ': ' END;
BEGIN
  SELECT * INTO bad FROM trainq.json_limit_violation(value, max_level);
  IF NOT FOUND THEN
    RETURN;
  END IF;
  name := CASE WHEN field = '' OR bad.path = '' OR left(bad.path, 1) = '[' THEN field || bad.path
               ELSE field || '.' || bad.path END;
  IF length(name) > 80 THEN
    name := left(name, 80) || '…';
  END IF;
  IF bad.too_deep THEN
    PERFORM trainq.refuse('TQ021', format('%sfield "%s" is nested more than 64 levels deep (the limit of a group''s JSON)',
      prefix, name));
  END IF;
  PERFORM trainq.refuse('TQ020', format('%sfield "%s" holds a number beyond the range of a double (|x| > 1.7976931348623157e308)',
    prefix, name));
END $$;

-- First element of a token-id array at or beyond `vocab_size`, as "index N (id)"; NULL if none.
CREATE FUNCTION trainq.first_token_beyond(ids jsonb, vocab_size integer) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
  SELECT format('index %s (%s)', o - 1, e)
  FROM jsonb_array_elements(CASE WHEN jsonb_typeof(ids) = 'array' THEN ids END) WITH ORDINALITY AS x (e, o)
  WHERE jsonb_typeof(e) = 'number' AND e::numeric >= vocab_size
  ORDER BY o LIMIT 1
$$;

-- Checks the token ids of trajectory `i` (pre-tokenized, or the assistant turns' sampler ids)
-- against the model's vocabulary.
CREATE FUNCTION trainq.check_token_range(i integer, t jsonb, model text, vocab_size integer) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  field text;
  bad text;
  j integer;
BEGIN
  IF vocab_size IS NULL THEN
    RETURN;
  END IF;
  FOREACH field IN ARRAY ARRAY['prompt_ids', 'completion_ids'] LOOP
    bad := trainq.first_token_beyond(t -> field, vocab_size);
    IF bad IS NOT NULL THEN
      PERFORM trainq.refuse('TQ022', format('trajectory %s: field "%s" holds %s, beyond model %s''s vocab_size %s',
        i, field, bad, model, vocab_size));
    END IF;
  END LOOP;
  IF jsonb_typeof(t -> 'messages') = 'array' THEN
    FOR j IN 0 .. jsonb_array_length(t -> 'messages') - 1 LOOP
      bad := trainq.first_token_beyond(t -> 'messages' -> j -> 'token_ids', vocab_size);
      IF bad IS NOT NULL THEN
        PERFORM trainq.refuse('TQ022', format('trajectory %s, message %s: field "token_ids" holds %s, beyond model %s''s vocab_size %s',
          i, j, bad, model, vocab_size));
      END IF;
    END LOOP;
  END IF;
END $$;

-- Checks trajectory `i` of a group and returns its reward (0002's checks, with the reward range
-- a double's statistics can hold: squares of rewards and of their deviations must neither
-- overflow nor underflow).
CREATE OR REPLACE FUNCTION trainq.check_trajectory(i integer, t jsonb) RETURNS double precision
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  r jsonb := t -> 'reward';
  field text;
  magnitude numeric;
BEGIN
  IF jsonb_typeof(t) IS DISTINCT FROM 'object' THEN
    PERFORM trainq.refuse('TQ003', format('trajectory %s: must be a JSON object, got %s', i, coalesce(jsonb_typeof(t), 'null')));
  END IF;
  IF r IS NULL OR jsonb_typeof(r) = 'null' THEN
    PERFORM trainq.refuse('TQ004', format('trajectory %s: field "reward" is missing', i));
  END IF;
  IF jsonb_typeof(r) = 'string' AND lower(r #>> '{}') IN ('nan', 'inf', '+inf', '-inf', 'infinity', '+infinity', '-infinity') THEN
    PERFORM trainq.refuse('TQ005', format('trajectory %s: field "reward" must be finite, got %s', i, r));
  END IF;
  IF jsonb_typeof(r) <> 'number' THEN
    PERFORM trainq.refuse('TQ004', format('trajectory %s: field "reward" must be a number, got %s', i, r));
  END IF;
  magnitude := abs(r::numeric);
  IF magnitude > 1e100 THEN
    PERFORM trainq.refuse('TQ005', format(
      'trajectory %s: field "reward" must be finite and at most 1e100 in magnitude, got about 1e%s', i, floor(log(magnitude))));
  END IF;
  IF magnitude > 0 AND magnitude < 1e-100 THEN
    PERFORM trainq.refuse('TQ005', format(
      'trajectory %s: field "reward" must be 0 or at least 1e-100 in magnitude (a double underflows below), got about 1e%s',
      i, floor(log(magnitude))));
  END IF;
  FOREACH field IN ARRAY ARRAY['metrics', 'metadata'] LOOP
    IF t ? field AND jsonb_typeof(t -> field) <> 'object' THEN
      PERFORM trainq.refuse('TQ018', format('trajectory %s: field "%s" must be a JSON object', i, field));
    END IF;
  END LOOP;
  IF t ? 'messages' THEN
    IF t ? 'prompt_ids' OR t ? 'completion_ids' THEN
      PERFORM trainq.refuse('TQ006', format('trajectory %s: give either "messages" or "prompt_ids"/"completion_ids", not both', i));
    END IF;
    PERFORM trainq.check_chat(i, t);
  ELSIF t ? 'prompt_ids' OR t ? 'completion_ids' THEN
    PERFORM trainq.check_tokens(format('trajectory %s', i), 'prompt_ids', t -> 'prompt_ids', NULL, true);
    PERFORM trainq.check_tokens(format('trajectory %s', i), 'completion_ids', t -> 'completion_ids', t -> 'logprobs', true);
    IF jsonb_array_length(t -> 'completion_ids') = 0 THEN
      PERFORM trainq.refuse('TQ006', format('trajectory %s: field "completion_ids" must not be empty', i));
    END IF;
  ELSE
    PERFORM trainq.refuse('TQ006', format('trajectory %s: field "messages" is missing (or give "prompt_ids" and "completion_ids")', i));
  END IF;
  RETURN r::double precision;
END $$;

-- Fast path of the JSON limits alone (also run on the group's metadata): two strict scans.
CREATE FUNCTION trainq.json_may_break_limits(value jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT jsonb_path_exists(value, 'strict $.**{65}')
      OR jsonb_path_exists(value, 'strict $.** ? (@.type() == "number" && (@ > 1.7976931348623157e308 || @ < -1.7976931348623157e308))')
$$;

-- Fast path (0005's scans, plus the new limits): true when any trajectory of the array might
-- break a rule, given the model's vocabulary size (NULL: unknown). One C-level jsonpath scan per
-- rule family; only flagged groups are walked to find the exact row, index, field and SQLSTATE.
-- Only immutable functions in the body, so that PostgreSQL inlines it into the trigger's
-- expression (jsonb_build_object is stable and would prevent that: +30 µs a group).
CREATE FUNCTION trainq.group_may_be_invalid(trajectories jsonb, vocab_size integer) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT
    -- trajectory level: object, reward a number a double's statistics can hold, object
    -- metrics/metadata, exactly one form
    jsonb_path_exists(trajectories, 'lax $[*] ? (
        @.type() != "object" || !exists(@.reward) || @.reward.type() != "number"
        || @.reward > 1e100 || @.reward < -1e100 || (@.reward != 0 && @.reward < 1e-100 && @.reward > -1e-100)
        || (exists(@.metrics) && @.metrics.type() != "object")
        || (exists(@.metadata) && @.metadata.type() != "object")
        || (exists(@.messages) && (exists(@.prompt_ids) || exists(@.completion_ids) || exists(@.logprobs)))
        || (!exists(@.messages) && !(exists(@.prompt_ids) && exists(@.completion_ids))))')
    -- chat form: a non-empty messages array with an assistant turn; well-formed tools
    OR jsonb_path_exists(trajectories, 'lax $[*] ? (exists(@.messages) && (
        @.messages.type() != "array" || @.messages.size() == 0
        || !exists(@.messages[*] ? (@.type() == "object" && @.role.type() == "string" && @.role == "assistant"))
        || (exists(@.tools) && @.tools.type() != "null" && (@.tools.type() != "array"
            || exists(@.tools[*] ? (@.type() != "object" || !exists(@.function.name) || @.function.name.type() != "string"))))))')
    -- messages: role, content, and what only assistant turns may carry
    OR jsonb_path_exists(trajectories, 'lax $[*] ? (exists(@.messages) && @.messages.type() == "array").messages[*] ? (
        @.type() != "object" || !exists(@.role) || @.role.type() != "string"
        || !(@.role == "system" || @.role == "developer" || @.role == "user" || @.role == "assistant" || @.role == "tool")
        || (@.role != "assistant" && (exists(@.tool_calls) || exists(@.token_ids) || exists(@.logprobs)))
        || ((!exists(@.content) || @.content.type() == "null") && !(@.role == "assistant" && exists(@.tool_calls)))
        || (exists(@.content) && !(@.content.type() == "string" || @.content.type() == "null" || @.content.type() == "array"))
        || (exists(@.content) && @.content.type() == "array"
            && exists(@.content[*] ? (@.type() != "object" || !exists(@."type") || @."type".type() != "string"))))')
    -- assistant tool calls
    OR jsonb_path_exists(trajectories, 'lax $[*] ? (exists(@.messages) && @.messages.type() == "array").messages[*] ? (
        @.type() == "object" && exists(@.tool_calls) && @.tool_calls.type() != "null" && (@.tool_calls.type() != "array"
        || exists(@.tool_calls[*] ? (@.type() != "object" || !exists(@.function) || @.function.type() != "object"
            || (exists(@."type") && !(@."type".type() == "string" && @."type" == "function"))
            || !exists(@.function.name) || @.function.name.type() != "string" || @.function.name == ""
            || !exists(@.function.arguments)
            || !(@.function.arguments.type() == "string" || @.function.arguments.type() == "object")))))')
    -- sampler tokens on assistant turns: integer ids in [0, vocab), log-probs <= 0 of the same length
    OR jsonb_path_exists(trajectories, 'lax $[*] ? (exists(@.messages) && @.messages.type() == "array").messages[*] ? (
        @.type() == "object" && (
          (exists(@.token_ids) && @.token_ids.type() != "null" && (@.token_ids.type() != "array"
            || exists(@.token_ids[*] ? (@.type() != "number" || @ < 0 || @ >= $id_limit || @ != @.floor()))))
          || (exists(@.logprobs) && @.logprobs.type() != "null" && (!exists(@.token_ids) || @.logprobs.type() != "array"
            || @.token_ids.type() != "array" || @.logprobs.size() != @.token_ids.size()
            || exists(@.logprobs[*] ? (@.type() != "number" || @ > 0))))))',
        ('{"id_limit": ' || least(coalesce(vocab_size, 2147483648), 2147483648)::text || '}')::jsonb)
    -- pre-tokenized form
    OR jsonb_path_exists(trajectories, 'lax $[*] ? (@.type() == "object" && !exists(@.messages) && (
        @.prompt_ids.type() != "array" || @.completion_ids.type() != "array" || @.completion_ids.size() == 0
        || exists(@.prompt_ids[*] ? (@.type() != "number" || @ < 0 || @ >= $id_limit || @ != @.floor()))
        || exists(@.completion_ids[*] ? (@.type() != "number" || @ < 0 || @ >= $id_limit || @ != @.floor()))
        || (exists(@.logprobs) && @.logprobs.type() != "null" && (@.logprobs.type() != "array"
            || @.logprobs.size() != @.completion_ids.size() || exists(@.logprobs[*] ? (@.type() != "number" || @ > 0))))))',
        ('{"id_limit": ' || least(coalesce(vocab_size, 2147483648), 2147483648)::text || '}')::jsonb)
    -- JSON limits: numbers a double holds, nesting at most 64 levels below the array
    OR trainq.json_may_break_limits(trajectories)
$$;

-- The one-argument form of 0005, kept for callers: the vocabulary unknown.
CREATE OR REPLACE FUNCTION trainq.group_may_be_invalid(trajectories jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT trainq.group_may_be_invalid($1, NULL)
$$;

-- BEFORE INSERT trigger: counts the row, validates it (fast path first) and fills the reward
-- statistics and the payload size.
CREATE OR REPLACE FUNCTION trainq.validate_group() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  m record;
  n integer;
  i integer;
  traj jsonb;
  row_number text;
BEGIN
  row_number := set_config('trainq.insert_row',
    (coalesce(nullif(current_setting('trainq.insert_row', true), ''), '0')::integer + 1)::text, true);
  IF NEW.model IS NULL THEN
    PERFORM trainq.refuse('TQ001', 'field "model" is missing');
  END IF;
  SELECT current_step, max_group_trajectories, max_group_bytes, vocab_size INTO m FROM trainq.models WHERE name = NEW.model;
  IF NOT FOUND THEN
    PERFORM trainq.refuse('TQ001', format('unknown model %s (register it with trainq model create)', quote_literal(NEW.model)));
  END IF;
  IF NEW.policy_version < 0 THEN
    PERFORM trainq.refuse('TQ014', format('field "policy_version" must not be negative, got %s', NEW.policy_version));
  END IF;
  IF NEW.policy_version > m.current_step THEN
    PERFORM trainq.refuse('TQ015', format('field "policy_version" %s is ahead of model %s''s current step %s',
      NEW.policy_version, NEW.model, m.current_step));
  END IF;
  IF NEW.metadata IS NOT NULL AND jsonb_typeof(NEW.metadata) <> 'object' THEN
    PERFORM trainq.refuse('TQ018', format('field "metadata" must be a JSON object, got %s', jsonb_typeof(NEW.metadata)));
  END IF;
  IF NEW.metadata IS NOT NULL AND trainq.json_may_break_limits(NEW.metadata) THEN
    PERFORM trainq.check_json_limits('', 'metadata', NEW.metadata, 64);
  END IF;
  IF jsonb_typeof(NEW.trajectories) IS DISTINCT FROM 'array' THEN
    PERFORM trainq.refuse('TQ002', format('field "trajectories" must be a JSON array of trajectories, got %s', coalesce(jsonb_typeof(NEW.trajectories), 'nothing')));
  END IF;
  -- `|| '[]'` returns the array itself, detoasted: read from another table (INSERT … SELECT, a
  -- temporary table filled by COPY) the value arrives compressed, and pg_column_size() of that
  -- is its compressed size. The checks below then read the detoasted copy once.
  traj := NEW.trajectories || '[]'::jsonb;
  n := jsonb_array_length(traj);
  IF n = 0 THEN
    PERFORM trainq.refuse('TQ002', 'field "trajectories" is empty: a group needs at least one trajectory');
  END IF;
  IF n > m.max_group_trajectories THEN
    PERFORM trainq.refuse('TQ016', format('field "trajectories" has %s trajectories, more than model %s''s limit of %s',
      n, NEW.model, m.max_group_trajectories));
  END IF;
  NEW.payload_bytes := pg_column_size(traj);
  IF NEW.payload_bytes > m.max_group_bytes THEN
    PERFORM trainq.refuse('TQ017', format('field "trajectories" is %s bytes, more than model %s''s limit of %s',
      NEW.payload_bytes, NEW.model, m.max_group_bytes));
  END IF;
  IF trainq.group_may_be_invalid(traj, m.vocab_size) THEN
    -- Walk the group to raise the exact error (the fast path may flag a group that is valid).
    FOR i IN 0 .. n - 1 LOOP
      PERFORM trainq.check_trajectory(i, traj -> i);
      PERFORM trainq.check_token_range(i, traj -> i, NEW.model, m.vocab_size);
      PERFORM trainq.check_json_limits(format('trajectory %s', i), '', traj -> i, 63);
    END LOOP;
  END IF;
  -- Reward statistics; the population std is computed in two passes, so equal rewards give 0.
  WITH rewards AS (SELECT (e ->> 'reward')::double precision AS reward FROM jsonb_array_elements(traj) e),
       group_mean AS (SELECT avg(reward) AS mean FROM rewards)
  SELECT count(*), g.mean, sqrt(sum((x.reward - g.mean) * (x.reward - g.mean)) / count(*)), count(DISTINCT x.reward)
  INTO NEW.reward_count, NEW.reward_mean, NEW.reward_std, NEW.reward_distinct
  FROM rewards x, group_mean g GROUP BY g.mean;
  RETURN NEW;
END $$;

-- 0004 revoked EXECUTE on the schema's functions from PUBLIC; the same for the ones added here
-- (the triggers run them as the owner).
REVOKE EXECUTE ON FUNCTION trainq.json_limit_violation(jsonb, integer), trainq.check_json_limits(text, text, jsonb, integer),
  trainq.first_token_beyond(jsonb, integer), trainq.check_token_range(integer, jsonb, text, integer),
  trainq.group_may_be_invalid(jsonb, integer), trainq.json_may_break_limits(jsonb) FROM PUBLIC;
