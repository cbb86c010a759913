-- Why this migration exists: retention deletes old checkpoints' objects from the store, and the
-- table must say so, or a reader of trainq.checkpoints (or of latest_checkpoint) would hand out a
-- URI that no longer exists. Rows are marked, never deleted: trainq.steps keeps pointing at them
-- and the history of what was trained stays complete. Safe on a live database: one nullable
-- column (no rewrite) and a replaced function body with the same signature and grants.

ALTER TABLE trainq.checkpoints ADD COLUMN deleted_at timestamptz;
COMMENT ON COLUMN trainq.checkpoints.deleted_at IS
  'When retention deleted this checkpoint''s objects from the store (NULL: still stored). Written by the worker.';

CREATE OR REPLACE FUNCTION trainq.latest_checkpoint(model text)
RETURNS TABLE (step bigint, uri text, format trainq.checkpoint_format, bytes bigint, sha256 text, created_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
  SELECT c.step, c.uri, c.format, c.bytes, c.sha256, c.created_at
  FROM trainq.checkpoints c
  WHERE c.model = $1 AND c.deleted_at IS NULL
  ORDER BY c.step DESC
  LIMIT 1
$$;
COMMENT ON FUNCTION trainq.latest_checkpoint(text) IS
  'The newest checkpoint of a model still in the store (one row), or no row before the first step.';
