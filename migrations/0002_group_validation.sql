-- Why this migration exists: producers write groups with plain SQL from any language, so the
-- database itself must refuse bad input — in the same statement, storing nothing — with a message
-- that names the trajectory index and the field, and a stable SQLSTATE in the custom class "TQ"
-- (listed in docs/sql-api.md; never renumbered). The same BEFORE INSERT trigger computes each
-- group's reward statistics (count, mean, population std, distinct values) so that the worker and
-- `trainq status` never recompute them. An AFTER INSERT statement trigger sends one
-- `NOTIFY trainq_groups, '<model>'` per model per statement so waiting workers wake at once.

-- Raises a trainq validation error with a fixed SQLSTATE.
CREATE FUNCTION trainq.refuse(code text, message text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message;
END $$;

-- First element of a JSON array that is not a non-negative integer, as "index N (value)"; NULL if all are.
CREATE FUNCTION trainq.first_bad_token_id(ids jsonb) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
  SELECT format('index %s (%s)', o - 1, e)
  FROM jsonb_array_elements(ids) WITH ORDINALITY AS x (e, o)
  WHERE CASE WHEN jsonb_typeof(e) = 'number' THEN e::numeric < 0 OR e::numeric <> trunc(e::numeric) OR e::numeric > 2147483647
             ELSE true END
  ORDER BY o LIMIT 1
$$;

-- First element of a JSON array that is not a number <= 0 (a log-probability); NULL if all are.
CREATE FUNCTION trainq.first_bad_logprob(lps jsonb) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
  SELECT format('index %s (%s)', o - 1, e)
  FROM jsonb_array_elements(lps) WITH ORDINALITY AS x (e, o)
  WHERE CASE WHEN jsonb_typeof(e) = 'number' THEN e::numeric > 0 ELSE true END
  ORDER BY o LIMIT 1
$$;

-- Checks a token-id array (and its optional log-probs) at location `at`, e.g. 'trajectory 2, message 1'.
CREATE FUNCTION trainq.check_tokens(at text, ids_field text, ids jsonb, logprobs jsonb, required boolean) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  bad text;
BEGIN
  IF ids IS NULL OR jsonb_typeof(ids) = 'null' THEN
    IF required THEN
      PERFORM trainq.refuse('TQ006', format('%s: field "%s" is missing', at, ids_field));
    END IF;
    IF logprobs IS NOT NULL AND jsonb_typeof(logprobs) <> 'null' THEN
      PERFORM trainq.refuse('TQ012', format('%s: field "logprobs" given without "%s"', at, ids_field));
    END IF;
    RETURN;
  END IF;
  IF jsonb_typeof(ids) <> 'array' THEN
    PERFORM trainq.refuse('TQ011', format('%s: field "%s" must be an array of non-negative integers, got %s', at, ids_field, jsonb_typeof(ids)));
  END IF;
  bad := trainq.first_bad_token_id(ids);
  IF bad IS NOT NULL THEN
    PERFORM trainq.refuse('TQ011', format('%s: field "%s" must hold non-negative integers, %s is not', at, ids_field, bad));
  END IF;
  IF logprobs IS NULL OR jsonb_typeof(logprobs) = 'null' THEN
    RETURN;
  END IF;
  IF jsonb_typeof(logprobs) <> 'array' THEN
    PERFORM trainq.refuse('TQ013', format('%s: field "logprobs" must be an array of numbers <= 0, got %s', at, jsonb_typeof(logprobs)));
  END IF;
  IF jsonb_array_length(logprobs) <> jsonb_array_length(ids) THEN
    PERFORM trainq.refuse('TQ012', format('%s: field "logprobs" has %s entries but "%s" has %s', at,
      jsonb_array_length(logprobs), ids_field, jsonb_array_length(ids)));
  END IF;
  bad := trainq.first_bad_logprob(logprobs);
  IF bad IS NOT NULL THEN
    PERFORM trainq.refuse('TQ013', format('%s: field "logprobs" must hold numbers <= 0, %s is not', at, bad));
  END IF;
END $$;

-- Checks one tool call of an assistant message.
CREATE FUNCTION trainq.check_tool_call(at text, call jsonb) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
  IF jsonb_typeof(call) <> 'object' OR jsonb_typeof(call -> 'function') IS DISTINCT FROM 'object' THEN
    PERFORM trainq.refuse('TQ010', format('%s: field "function" must be an object with "name" and "arguments"', at));
  END IF;
  IF call ? 'type' AND call ->> 'type' IS DISTINCT FROM 'function' THEN
    PERFORM trainq.refuse('TQ010', format('%s: field "type" must be "function"', at));
  END IF;
  IF jsonb_typeof(call -> 'function' -> 'name') IS DISTINCT FROM 'string' OR call -> 'function' ->> 'name' = '' THEN
    PERFORM trainq.refuse('TQ010', format('%s: field "function.name" must be a non-empty string', at));
  END IF;
  IF jsonb_typeof(call -> 'function' -> 'arguments') NOT IN ('string', 'object') OR NOT (call -> 'function' ? 'arguments') THEN
    PERFORM trainq.refuse('TQ010', format('%s: field "function.arguments" must be a JSON string or object', at));
  END IF;
END $$;

-- Checks one chat message; returns true when it is an assistant turn.
CREATE FUNCTION trainq.check_message(at text, msg jsonb) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  role text;
  content jsonb;
  k integer;
BEGIN
  IF jsonb_typeof(msg) IS DISTINCT FROM 'object' THEN
    PERFORM trainq.refuse('TQ007', format('%s: must be a JSON object, got %s', at, coalesce(jsonb_typeof(msg), 'null')));
  END IF;
  role := msg ->> 'role';
  IF role IS NULL OR role NOT IN ('system', 'developer', 'user', 'assistant', 'tool') THEN
    PERFORM trainq.refuse('TQ007', format('%s: field "role" must be one of system, developer, user, assistant, tool, got %s',
      at, coalesce(msg -> 'role', 'null'::jsonb)));
  END IF;
  content := msg -> 'content';
  IF content IS NULL OR jsonb_typeof(content) = 'null' THEN
    IF role <> 'assistant' OR NOT (msg ? 'tool_calls') THEN
      PERFORM trainq.refuse('TQ008', format('%s: field "content" is missing (%s message)', at, role));
    END IF;
  ELSIF jsonb_typeof(content) = 'array' THEN
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(content) p
               WHERE jsonb_typeof(p) <> 'object' OR jsonb_typeof(p -> 'type') IS DISTINCT FROM 'string') THEN
      PERFORM trainq.refuse('TQ008', format('%s: field "content" parts must be objects with a string "type"', at));
    END IF;
  ELSIF jsonb_typeof(content) <> 'string' THEN
    PERFORM trainq.refuse('TQ008', format('%s: field "content" must be a string or an array of parts, got %s', at, jsonb_typeof(content)));
  END IF;
  IF msg ? 'tool_calls' AND jsonb_typeof(msg -> 'tool_calls') <> 'null' THEN
    IF role <> 'assistant' OR jsonb_typeof(msg -> 'tool_calls') <> 'array' THEN
      PERFORM trainq.refuse('TQ010', format('%s: field "tool_calls" must be an array on an assistant message', at));
    END IF;
    FOR k IN 0 .. jsonb_array_length(msg -> 'tool_calls') - 1 LOOP
      PERFORM trainq.check_tool_call(format('%s, tool call %s', at, k), msg -> 'tool_calls' -> k);
    END LOOP;
  END IF;
  IF role = 'assistant' THEN
    PERFORM trainq.check_tokens(at, 'token_ids', msg -> 'token_ids', msg -> 'logprobs', false);
  ELSIF msg ? 'token_ids' OR msg ? 'logprobs' THEN
    PERFORM trainq.refuse('TQ011', format('%s: fields "token_ids"/"logprobs" are only allowed on assistant messages', at));
  END IF;
  RETURN role = 'assistant';
END $$;

-- Checks the chat form of trajectory `i`: messages (with an assistant turn) and tools.
CREATE FUNCTION trainq.check_chat(i integer, t jsonb) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  msgs jsonb := t -> 'messages';
  assistants integer := 0;
  j integer;
BEGIN
  IF jsonb_typeof(msgs) IS DISTINCT FROM 'array' OR jsonb_array_length(msgs) = 0 THEN
    PERFORM trainq.refuse('TQ006', format('trajectory %s: field "messages" must be a non-empty array, got %s', i, coalesce(jsonb_typeof(msgs), 'nothing')));
  END IF;
  FOR j IN 0 .. jsonb_array_length(msgs) - 1 LOOP
    IF trainq.check_message(format('trajectory %s, message %s', i, j), msgs -> j) THEN
      assistants := assistants + 1;
    END IF;
  END LOOP;
  IF assistants = 0 THEN
    PERFORM trainq.refuse('TQ009', format('trajectory %s: field "messages" has no assistant turn to train on', i));
  END IF;
  IF t ? 'tools' AND jsonb_typeof(t -> 'tools') <> 'null' AND (jsonb_typeof(t -> 'tools') <> 'array' OR EXISTS (
       SELECT 1 FROM jsonb_array_elements(t -> 'tools') x
       WHERE jsonb_typeof(x) <> 'object' OR jsonb_typeof(x -> 'function' -> 'name') IS DISTINCT FROM 'string')) THEN
    PERFORM trainq.refuse('TQ019', format('trajectory %s: field "tools" must be an array of {"type": "function", "function": {"name": ...}}', i));
  END IF;
END $$;

-- Checks trajectory `i` of a group and returns its reward.
CREATE FUNCTION trainq.check_trajectory(i integer, t jsonb) RETURNS double precision
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  r jsonb := t -> 'reward';
  field text;
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
  IF abs(r::numeric) > 1e300 THEN
    PERFORM trainq.refuse('TQ005', format('trajectory %s: field "reward" must be finite, got a number beyond 1e300 in magnitude', i));
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

-- BEFORE INSERT trigger: validates the row and fills the reward statistics.
CREATE FUNCTION trainq.validate_group() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  m record;
  n integer;
  i integer;
  rewards double precision[];
  mean double precision;
BEGIN
  IF NEW.model IS NULL THEN
    PERFORM trainq.refuse('TQ001', 'field "model" is missing');
  END IF;
  SELECT current_step, max_group_trajectories, max_group_bytes INTO m FROM trainq.models WHERE name = NEW.model;
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
  IF jsonb_typeof(NEW.trajectories) IS DISTINCT FROM 'array' THEN
    PERFORM trainq.refuse('TQ002', format('field "trajectories" must be a JSON array of trajectories, got %s', coalesce(jsonb_typeof(NEW.trajectories), 'nothing')));
  END IF;
  n := jsonb_array_length(NEW.trajectories);
  IF n = 0 THEN
    PERFORM trainq.refuse('TQ002', 'field "trajectories" is empty: a group needs at least one trajectory');
  END IF;
  IF n > m.max_group_trajectories THEN
    PERFORM trainq.refuse('TQ016', format('field "trajectories" has %s trajectories, more than model %s''s limit of %s',
      n, NEW.model, m.max_group_trajectories));
  END IF;
  NEW.payload_bytes := pg_column_size(NEW.trajectories);
  IF NEW.payload_bytes > m.max_group_bytes THEN
    PERFORM trainq.refuse('TQ017', format('field "trajectories" is %s bytes, more than model %s''s limit of %s',
      NEW.payload_bytes, NEW.model, m.max_group_bytes));
  END IF;
  rewards := array_fill(0::double precision, ARRAY[n]);
  FOR i IN 0 .. n - 1 LOOP
    rewards[i + 1] := trainq.check_trajectory(i, NEW.trajectories -> i);
  END LOOP;
  SELECT avg(r), count(DISTINCT r) INTO mean, NEW.reward_distinct FROM unnest(rewards) r;
  NEW.reward_count := n;
  NEW.reward_mean := mean;
  NEW.reward_std := (SELECT sqrt(sum((r - mean) * (r - mean)) / n) FROM unnest(rewards) r);
  RETURN NEW;
END $$;

CREATE TRIGGER groups_validate BEFORE INSERT ON trainq.groups
  FOR EACH ROW EXECUTE FUNCTION trainq.validate_group();

-- AFTER INSERT statement trigger: one NOTIFY trainq_groups per model inserted.
CREATE FUNCTION trainq.notify_groups() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('trainq_groups', s.model) FROM (SELECT DISTINCT model FROM inserted) s;
  RETURN NULL;
END $$;

CREATE TRIGGER groups_notify AFTER INSERT ON trainq.groups
  REFERENCING NEW TABLE AS inserted
  FOR EACH STATEMENT EXECUTE FUNCTION trainq.notify_groups();
