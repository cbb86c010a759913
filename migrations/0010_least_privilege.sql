-- Why this migration exists: no role should be able to stall or fool the queue beyond what its
-- job needs (issue 13).
--   * The commit lock was a session advisory lock on a documented key, which any role that can
--     connect may take, so a producer could stall every commit of a model. It is now a row lock
--     (SELECT … FOR UPDATE) on `trainq.commit_locks`, and locking a row needs UPDATE on its table,
--     which only trainq_worker has.
--   * trainq_worker could UPDATE any column of every table (a model's `base`, steps, checkpoint
--     URIs) and INSERT groups with a forged `submitted_by`. It now holds exactly what the worker's
--     queries need (crates/trainq-queue/src/db/): SELECT everywhere, UPDATE of the queue columns
--     of groups, of `models.current_step`, of `checkpoints.deleted_at` and of its own `workers`
--     row, INSERT of steps, checkpoints, skipped passes and worker rows, and the rendezvous table.
--   * A group whose claim ended without a result (lease expired, released after an error) waits
--     `queue.retry_backoff_seconds × 2^(attempts − 1)` (at most 16 times that) before it can be
--     claimed again (`groups.retry_after`), so a worker that crash-loops on one batch claims
--     other groups first instead of burning that batch's attempts in a row.
-- On a live database: a new table, one nullable column, grants; the tables are locked up front
-- in the order writers take them (groups, then models) with a bounded wait, as in 0009. Stop the
-- workers of every model before this migration: a worker of an older release takes the old
-- advisory lock, which does not exclude the new row lock (docs/worker-operations.md).

SET LOCAL lock_timeout = '10s';
LOCK TABLE trainq.groups, trainq.models IN ACCESS EXCLUSIVE MODE;

CREATE TABLE trainq.commit_locks (
    model text PRIMARY KEY REFERENCES trainq.models (name) ON DELETE CASCADE
);
COMMENT ON TABLE trainq.commit_locks IS
  'One row per model; a worker holds its row locked (FOR UPDATE) from the start of a checkpoint upload to the end of the '
  'step commit. Written by workers only (a row is added on a model''s first commit).';
INSERT INTO trainq.commit_locks (model) SELECT name FROM trainq.models ON CONFLICT DO NOTHING;

ALTER TABLE trainq.groups ADD COLUMN retry_after timestamptz;
COMMENT ON COLUMN trainq.groups.retry_after IS
  'A pending group is not claimed before this time: set when a claim of it ended without a result '
  '(queue.retry_backoff_seconds doubling with each attempt). NULL: claimable now.';

REVOKE ALL ON ALL TABLES IN SCHEMA trainq FROM trainq_worker;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA trainq FROM trainq_worker;
GRANT SELECT ON ALL TABLES IN SCHEMA trainq TO trainq_worker;
GRANT UPDATE (state, skip_reason, skip_std, skip_detail, claim_token, claimed_by, claimed_at, lease_expires_at,
              attempts, step, error, finished_at, retry_after) ON trainq.groups TO trainq_worker;
GRANT UPDATE (current_step) ON trainq.models TO trainq_worker;
GRANT INSERT ON trainq.steps, trainq.checkpoints, trainq.skipped_passes, trainq.workers TO trainq_worker;
GRANT UPDATE (deleted_at) ON trainq.checkpoints TO trainq_worker;
GRANT UPDATE (host, model, devices, started_at, heartbeat_at) ON trainq.workers TO trainq_worker;
GRANT INSERT, UPDATE, DELETE ON trainq.rendezvous TO trainq_worker;
GRANT INSERT, UPDATE ON trainq.commit_locks TO trainq_worker;
GRANT EXECUTE ON FUNCTION trainq.refuse(text, text), trainq.latest_checkpoint(text), trainq.group_status(uuid)
  TO trainq_worker;
