-- Why this migration exists: producers stream groups one at a time, and the worker used to train
-- on whatever was pending when it looked — one step per group, the rest then stale — and said
-- nothing about what it skipped. Steps now assemble a batch of `groups_per_step` eligible groups
-- (waiting up to `max_batch_wait_seconds`), and the records have to show what happened:
--   * trainq.steps gains the batch it wanted, the reward of every group it claimed (trained and
--     skipped separately), and how much of its training was corrected by sampler log-probs;
--   * trainq.skipped_passes records a claim whose groups were all skipped (no step is taken, so
--     no steps row exists), so reward curves show saturation instead of hiding it;
--   * a group with NULL policy_version (sampled from an unknown checkpoint) is refused at insert
--     when its model's config says `queue.unknown_policy_version = "refuse"` (SQLSTATE TQ030).
-- Safe on a live database: nullable columns without rewrite, a new table, one more trigger.

ALTER TABLE trainq.steps
    ADD COLUMN groups_wanted         integer,
    ADD COLUMN reward_mean_claimed   double precision,
    ADD COLUMN reward_mean_skipped   double precision,
    ADD COLUMN logprob_coverage      double precision,
    ADD COLUMN importance_ratio_mean double precision,
    ADD CONSTRAINT steps_groups_wanted_positive CHECK (groups_wanted > 0),
    ADD CONSTRAINT steps_logprob_coverage_is_share CHECK (logprob_coverage BETWEEN 0 AND 1);
COMMENT ON COLUMN trainq.steps.groups_wanted IS
  'groups_per_step when the step was taken; groups_trained + skipped below it means a short batch (max_batch_wait_seconds ran out).';
COMMENT ON COLUMN trainq.steps.reward_mean IS 'Mean reward over the trajectories of the trained groups.';
COMMENT ON COLUMN trainq.steps.reward_mean_claimed IS 'Mean reward over the trajectories of every group the step claimed, trained or skipped.';
COMMENT ON COLUMN trainq.steps.reward_mean_skipped IS 'Mean reward over the trajectories of the groups the step claimed and skipped (NULL: none skipped).';
COMMENT ON COLUMN trainq.steps.logprob_coverage IS 'Share of trained tokens that carried a sampler log-prob (the rest train with importance ratio 1).';
COMMENT ON COLUMN trainq.steps.importance_ratio_mean IS 'Mean importance ratio exp(logp - sampler logp) over trained tokens (1 where no sampler log-prob).';
COMMENT ON COLUMN trainq.steps.policy_lag_min IS
  'Smallest current_step - policy_version among trained groups, current_step being the checkpoint the step started from (on-policy: 0).';

CREATE TABLE trainq.skipped_passes (
    id                  bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    model               text        NOT NULL REFERENCES trainq.models (name),
    current_step        bigint      NOT NULL,
    worker_id           text        NOT NULL,
    started_at          timestamptz NOT NULL,
    finished_at         timestamptz NOT NULL DEFAULT now(),
    groups_claimed      integer     NOT NULL,
    groups_skipped      jsonb       NOT NULL,
    reward_mean_claimed double precision,
    reward_std_mean     double precision,
    CONSTRAINT skipped_passes_claimed_positive CHECK (groups_claimed > 0),
    CONSTRAINT skipped_passes_skipped_is_object CHECK (jsonb_typeof(groups_skipped) = 'object')
);
CREATE INDEX skipped_passes_by_model ON trainq.skipped_passes (model, id);
COMMENT ON TABLE trainq.skipped_passes IS
  'One row per claim whose groups were all skipped (no step taken): the record that keeps saturation visible.';
COMMENT ON COLUMN trainq.skipped_passes.current_step IS 'The model''s current step when the groups were claimed (the step that was not taken is current_step + 1).';
COMMENT ON COLUMN trainq.skipped_passes.groups_skipped IS 'Skipped groups counted by reason, e.g. {"zero_variance": 8}.';
COMMENT ON COLUMN trainq.skipped_passes.reward_mean_claimed IS 'Mean reward over the trajectories of the skipped groups.';
COMMENT ON COLUMN trainq.skipped_passes.reward_std_mean IS 'Mean over the skipped groups of each group''s own reward std.';
GRANT SELECT ON trainq.skipped_passes TO trainq_worker;
GRANT INSERT ON trainq.skipped_passes TO trainq_worker;

-- BEFORE INSERT row trigger, after groups_validate (triggers fire in name order): a group
-- without policy_version is refused when its model says queue.unknown_policy_version = "refuse".
CREATE FUNCTION trainq.check_policy_version_known() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  IF NEW.policy_version IS NULL AND EXISTS (
       SELECT 1 FROM trainq.models m
       WHERE m.name = NEW.model AND m.config -> 'queue' ->> 'unknown_policy_version' = 'refuse') THEN
    PERFORM trainq.refuse('TQ030', format(
      'field "policy_version" is missing: model %s trains only groups whose checkpoint step is known '
      '(its config sets queue.unknown_policy_version = "refuse")', NEW.model));
  END IF;
  RETURN NEW;
END $$;
REVOKE EXECUTE ON FUNCTION trainq.check_policy_version_known() FROM PUBLIC;

CREATE TRIGGER groups_validate_policy_version BEFORE INSERT ON trainq.groups
  FOR EACH ROW EXECUTE FUNCTION trainq.check_policy_version_known();
