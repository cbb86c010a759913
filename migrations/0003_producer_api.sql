-- Why this migration exists: producers in any language should not need to know the queue's
-- columns to submit a group or to find the newest weights. These three functions are the whole
-- producer API besides the plain INSERT: `submit_group` (the INSERT with named arguments),
-- `latest_checkpoint` (what inference servers poll) and `group_status` (how a producer follows
-- its own group). group_status runs with the caller's rights, so row-level security (0004) limits
-- a producer to its own groups.

CREATE FUNCTION trainq.submit_group(
    model text,
    trajectories jsonb,
    policy_version bigint DEFAULT NULL,
    metadata jsonb DEFAULT '{}'
) RETURNS uuid
LANGUAGE sql VOLATILE AS $$
  INSERT INTO trainq.groups (model, trajectories, policy_version, metadata)
  VALUES ($1, $2, $3, coalesce($4, '{}'::jsonb))
  RETURNING id
$$;
COMMENT ON FUNCTION trainq.submit_group(text, jsonb, bigint, jsonb) IS
  'Submits one group (same validation and SQLSTATEs as INSERT INTO trainq.groups) and returns its id.';

CREATE FUNCTION trainq.latest_checkpoint(model text)
RETURNS TABLE (step bigint, uri text, format trainq.checkpoint_format, bytes bigint, sha256 text, created_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
  SELECT c.step, c.uri, c.format, c.bytes, c.sha256, c.created_at
  FROM trainq.checkpoints c
  WHERE c.model = $1
  ORDER BY c.step DESC
  LIMIT 1
$$;
COMMENT ON FUNCTION trainq.latest_checkpoint(text) IS
  'The newest checkpoint of a model (one row), or no row before the first step.';

CREATE FUNCTION trainq.group_status(id uuid)
RETURNS TABLE (model text, state trainq.group_state, skip_reason trainq.skip_reason, step bigint, attempts integer,
               error text, reward_count integer, reward_mean double precision, reward_std double precision,
               created_at timestamptz, finished_at timestamptz)
LANGUAGE sql STABLE AS $$
  SELECT g.model, g.state, g.skip_reason, g.step, g.attempts, g.error, g.reward_count, g.reward_mean, g.reward_std,
         g.created_at, g.finished_at
  FROM trainq.groups g
  WHERE g.id = $1
$$;
COMMENT ON FUNCTION trainq.group_status(uuid) IS
  'State of one group: no row when it does not exist or (for a producer) was submitted by another role.';
