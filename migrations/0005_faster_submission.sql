-- Why this migration exists: with 8 concurrent producers, validated submission ran at 18-21 % of
-- the rate of a raw INSERT of the same bytes (ops/bench/RESULTS.md); the goal is at least 50 %.
-- Two causes, two fixes, same contract (same checks, same SQLSTATEs and messages):
--   1. The trigger walked every trajectory and message in PL/pgSQL. Now a few jsonpath scans in C
--      (trainq.group_may_be_invalid) flag any group that might break a rule, and only flagged
--      groups are walked to raise the exact error; statistics come from one SQL query.
--   2. Every insert sent NOTIFY, and a notifying transaction holds a cluster-wide lock through its
--      commit, so concurrent producers committed one at a time. Now one transaction per model
--      notifies at a time (see trainq.notify_groups below).
-- It also drops the index groups_by_model_state: every claim and completion paid for it, and
-- only `trainq status` read it.

DROP INDEX IF EXISTS trainq.groups_by_model_state;

-- Fast path: true when any trajectory of the array might break a rule. One C-level jsonpath scan
-- per rule family instead of a PL/pgSQL walk; only groups it flags are walked by
-- trainq.check_trajectory to find the exact index, field and SQLSTATE. Every comparison is
-- guarded by a type test so that an unexpected shape flags the group instead of passing unseen.
CREATE FUNCTION trainq.group_may_be_invalid(trajectories jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT
    -- trajectory level: object, finite numeric reward, object metrics/metadata, exactly one form
    jsonb_path_exists(trajectories, 'lax $[*] ? (
        @.type() != "object" || !exists(@.reward) || @.reward.type() != "number"
        || @.reward > 1e300 || @.reward < -1e300
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
    -- sampler tokens on assistant turns: non-negative integer ids, log-probs <= 0 of the same length
    OR jsonb_path_exists(trajectories, 'lax $[*] ? (exists(@.messages) && @.messages.type() == "array").messages[*] ? (
        @.type() == "object" && (
          (exists(@.token_ids) && @.token_ids.type() != "null" && (@.token_ids.type() != "array"
            || exists(@.token_ids[*] ? (@.type() != "number" || @ < 0 || @ > 2147483647 || @ != @.floor()))))
          || (exists(@.logprobs) && @.logprobs.type() != "null" && (!exists(@.token_ids) || @.logprobs.type() != "array"
            || @.token_ids.type() != "array" || @.logprobs.size() != @.token_ids.size()
            || exists(@.logprobs[*] ? (@.type() != "number" || @ > 0))))))')
    -- pre-tokenized form
    OR jsonb_path_exists(trajectories, 'lax $[*] ? (@.type() == "object" && !exists(@.messages) && (
        @.prompt_ids.type() != "array" || @.completion_ids.type() != "array" || @.completion_ids.size() == 0
        || exists(@.prompt_ids[*] ? (@.type() != "number" || @ < 0 || @ > 2147483647 || @ != @.floor()))
        || exists(@.completion_ids[*] ? (@.type() != "number" || @ < 0 || @ > 2147483647 || @ != @.floor()))
        || (exists(@.logprobs) && @.logprobs.type() != "null" && (@.logprobs.type() != "array"
            || @.logprobs.size() != @.completion_ids.size() || exists(@.logprobs[*] ? (@.type() != "number" || @ > 0))))))')
$$;

-- BEFORE INSERT trigger: validates the row (fast path first) and fills the reward statistics.
CREATE OR REPLACE FUNCTION trainq.validate_group() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  m record;
  n integer;
  i integer;
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
  IF trainq.group_may_be_invalid(NEW.trajectories) THEN
    -- Walk the group to raise the exact error (the fast path may flag a group that is valid).
    FOR i IN 0 .. n - 1 LOOP
      PERFORM trainq.check_trajectory(i, NEW.trajectories -> i);
    END LOOP;
  END IF;
  -- Reward statistics; the population std is computed in two passes, so equal rewards give 0.
  WITH rewards AS (SELECT (e ->> 'reward')::double precision AS reward FROM jsonb_array_elements(NEW.trajectories) e),
       group_mean AS (SELECT avg(reward) AS mean FROM rewards)
  SELECT count(*), g.mean, sqrt(sum((x.reward - g.mean) * (x.reward - g.mean)) / count(*)), count(DISTINCT x.reward)
  INTO NEW.reward_count, NEW.reward_mean, NEW.reward_std, NEW.reward_distinct
  FROM rewards x, group_mean g GROUP BY g.mean;
  RETURN NEW;
END $$;

-- AFTER INSERT statement trigger: NOTIFY trainq_groups, '<model>' for each model inserted.
--
-- A transaction that notifies holds a cluster-wide lock while it commits, so concurrent producers
-- that all notified would commit one at a time (measured: 18% of the raw INSERT rate with 8
-- producers, 73% without). So only one transaction per model notifies at a time: the one that
-- gets the transaction-scoped advisory lock (class 1953653105, a constant of trainq's; key = hashtext(model));
-- a concurrent inserter of the same model skips its NOTIFY, because the holder's notification,
-- sent when it commits, wakes the waiters, who then look at the table. Waiters also poll.
CREATE OR REPLACE FUNCTION trainq.notify_groups() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('trainq_groups', s.model)
  FROM (SELECT DISTINCT model FROM inserted) s
  WHERE pg_try_advisory_xact_lock(1953653105, hashtext(s.model));
  RETURN NULL;
END $$;


-- 0004 revoked EXECUTE on the schema's functions from PUBLIC and granted it to workers; do the
-- same for the function this migration adds (the trigger runs it as the owner).
REVOKE EXECUTE ON FUNCTION trainq.group_may_be_invalid(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION trainq.group_may_be_invalid(jsonb) TO trainq_worker;
