-- Why this migration exists: producers are agents we do not fully trust, so the database must
-- hold them to the contract: a member of `trainq_producer` may INSERT the four submission columns
-- of trainq.groups and EXECUTE the producer functions, and nothing else — no UPDATE, no DELETE, no
-- other table, and (through row-level security keyed on `submitted_by = current_user`) no view of
-- another producer's groups. `trainq_worker` runs the queue. Roles are cluster-wide while this
-- migration runs once per database, so creating them tolerates their existing already (and a
-- concurrent migration of another database creating them at the same moment).

DO $$
DECLARE
  r text;
BEGIN
  FOREACH r IN ARRAY ARRAY['trainq_producer', 'trainq_worker'] LOOP
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      BEGIN
        EXECUTE format('CREATE ROLE %I NOLOGIN', r);
      EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;
      END;
    END IF;
  END LOOP;
END $$;

REVOKE ALL ON SCHEMA trainq FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA trainq FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA trainq FROM PUBLIC;
GRANT USAGE ON SCHEMA trainq TO trainq_producer, trainq_worker;

-- Producers: the submission columns, their own rows' status columns, the producer functions.
GRANT INSERT (model, trajectories, policy_version, metadata) ON trainq.groups TO trainq_producer;
GRANT SELECT (id, model, policy_version, submitted_by, state, skip_reason, reward_count, reward_mean, reward_std,
              reward_distinct, step, attempts, error, created_at, finished_at) ON trainq.groups TO trainq_producer;
GRANT EXECUTE ON FUNCTION trainq.uuidv7(), trainq.submit_group(text, jsonb, bigint, jsonb),
  trainq.latest_checkpoint(text), trainq.group_status(uuid) TO trainq_producer;

-- Workers: the queue.
GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA trainq TO trainq_worker;
GRANT DELETE ON trainq.workers TO trainq_worker;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA trainq TO trainq_worker;

ALTER TABLE trainq.groups ENABLE ROW LEVEL SECURITY;
CREATE POLICY groups_producer_inserts_own ON trainq.groups FOR INSERT TO trainq_producer
  WITH CHECK (submitted_by = current_user);
CREATE POLICY groups_producer_reads_own ON trainq.groups FOR SELECT TO trainq_producer
  USING (submitted_by = current_user);
CREATE POLICY groups_worker_runs_queue ON trainq.groups TO trainq_worker
  USING (true) WITH CHECK (true);
