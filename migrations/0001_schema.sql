-- Why this migration exists: it creates schema `trainq` and the tables every other part of
-- trainq meets in. Agents insert one row per trajectory group into `trainq.groups`; a worker
-- claims pending groups with a lease and a claim token, records each optimizer step in
-- `trainq.steps` and its uploaded weights in `trainq.checkpoints`, and advances
-- `trainq.models.current_step`. Invariants live here as enum types and named CHECK constraints so
-- that no client, in any language, can store a group in an impossible state.
--
-- Trajectories are stored inside their group row (a jsonb array) rather than in a table of their
-- own: a group is always submitted, validated, claimed and trained as a unit, so one row means one
-- index entry and one heap tuple per submission (the insert path is the hot path), one atomic
-- write, and the claim returns the group exactly as the producer sent it. The view
-- `trainq.trajectories` gives the one-row-per-trajectory shape for ad-hoc queries.

CREATE SCHEMA IF NOT EXISTS trainq;

-- A version-7 UUID (RFC 9562): 48 bits of Unix milliseconds, then random bits. PostgreSQL 15 has no
-- built-in; this turns a random v4 UUID into v7 by writing the timestamp over its first six bytes
-- and setting the version nibble from 0100 to 0111 (bits 52 and 53). Ids therefore sort by
-- submission time, which keeps the primary-key index append-mostly and the claim order FIFO.
CREATE FUNCTION trainq.uuidv7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
  SELECT encode(
    set_bit(set_bit(
      overlay(uuid_send(gen_random_uuid())
              PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
              FROM 1 FOR 6),
      52, 1), 53, 1),
    'hex')::uuid
$$;
COMMENT ON FUNCTION trainq.uuidv7() IS
  'A time-ordered version-7 UUID (48-bit Unix milliseconds + random bits); the default id of trainq.groups.';

CREATE TYPE trainq.group_state AS ENUM ('pending', 'claimed', 'trained', 'skipped', 'failed');
COMMENT ON TYPE trainq.group_state IS
  'Lifecycle of a group: pending -> claimed -> trained | skipped | failed (a lost lease returns claimed -> pending).';

CREATE TYPE trainq.skip_reason AS ENUM ('zero_variance', 'stale', 'invalid', 'too_long');
COMMENT ON TYPE trainq.skip_reason IS
  'Why a claimed group was not trained: zero_variance (population std of its own rewards below tolerance), '
  'stale (current_step - policy_version beyond the accepted staleness), invalid (could not be rendered or tokenized), '
  'too_long (a trajectory longer than max_seq_len).';

CREATE TYPE trainq.checkpoint_format AS ENUM ('peft_lora', 'hf_full');
COMMENT ON TYPE trainq.checkpoint_format IS
  'Layout of an uploaded checkpoint: PEFT LoRA adapter or full Hugging Face weights.';

CREATE TABLE trainq.models (
    name                   text        PRIMARY KEY,
    base                   text        NOT NULL,
    config                 jsonb       NOT NULL DEFAULT '{}',
    current_step           bigint      NOT NULL DEFAULT 0,
    max_group_trajectories integer     NOT NULL DEFAULT 256,
    max_group_bytes        integer     NOT NULL DEFAULT 16777216,
    created_at             timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT models_name_is_simple CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'),
    CONSTRAINT models_base_not_empty CHECK (base <> ''),
    CONSTRAINT models_config_is_object CHECK (jsonb_typeof(config) = 'object'),
    CONSTRAINT models_current_step_not_negative CHECK (current_step >= 0),
    CONSTRAINT models_group_limits_positive CHECK (max_group_trajectories > 0 AND max_group_bytes > 0)
);
COMMENT ON TABLE trainq.models IS 'Policies being trained; groups name their model here.';
COMMENT ON COLUMN trainq.models.name IS 'Model name that producers put in trainq.groups.model (letters, digits, ".", "_", "-").';
COMMENT ON COLUMN trainq.models.base IS 'Base model location: a local directory or a URL.';
COMMENT ON COLUMN trainq.models.config IS 'Training config (trainq TrainConfig as JSON, every default filled in), validated by trainq on create.';
COMMENT ON COLUMN trainq.models.current_step IS 'Last committed optimizer step; 0 before training. A group''s policy_version may not exceed it.';
COMMENT ON COLUMN trainq.models.max_group_trajectories IS 'Largest number of trajectories accepted in one group (SQLSTATE TQ016 beyond).';
COMMENT ON COLUMN trainq.models.max_group_bytes IS 'Largest jsonb size in bytes of one group''s trajectories (SQLSTATE TQ017 beyond).';

CREATE TABLE trainq.groups (
    id               uuid               PRIMARY KEY DEFAULT trainq.uuidv7(),
    model            text               NOT NULL REFERENCES trainq.models (name),
    policy_version   bigint,
    trajectories     jsonb              NOT NULL,
    metadata         jsonb              NOT NULL DEFAULT '{}',
    submitted_by     name               NOT NULL DEFAULT current_user,
    state            trainq.group_state NOT NULL DEFAULT 'pending',
    skip_reason      trainq.skip_reason,
    skip_std         double precision,
    skip_detail      text,
    reward_count     integer            NOT NULL DEFAULT 0,
    reward_mean      double precision,
    reward_std       double precision,
    reward_distinct  integer,
    payload_bytes    integer,
    claim_token      uuid,
    claimed_by       text,
    claimed_at       timestamptz,
    lease_expires_at timestamptz,
    attempts         integer            NOT NULL DEFAULT 0,
    step             bigint,
    error            text,
    created_at       timestamptz        NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    CONSTRAINT groups_trajectories_is_array CHECK (jsonb_typeof(trajectories) = 'array'),
    CONSTRAINT groups_metadata_is_object CHECK (jsonb_typeof(metadata) = 'object'),
    CONSTRAINT groups_policy_version_not_negative CHECK (policy_version >= 0),
    CONSTRAINT groups_attempts_not_negative CHECK (attempts >= 0),
    CONSTRAINT groups_reward_stats_present CHECK (reward_count > 0 AND reward_mean IS NOT NULL AND reward_std >= 0 AND reward_distinct BETWEEN 1 AND reward_count),
    CONSTRAINT groups_claimed_has_lease CHECK (state <> 'claimed' OR (claim_token IS NOT NULL AND claimed_by IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CONSTRAINT groups_pending_has_no_claim CHECK (state <> 'pending' OR (claim_token IS NULL AND lease_expires_at IS NULL)),
    CONSTRAINT groups_skipped_or_skip_reason_null CHECK ((state = 'skipped') = (skip_reason IS NOT NULL)),
    CONSTRAINT groups_trained_has_step CHECK (state <> 'trained' OR step IS NOT NULL),
    CONSTRAINT groups_failed_has_error CHECK (state <> 'failed' OR error IS NOT NULL),
    CONSTRAINT groups_finished_or_finished_at_null CHECK ((state IN ('trained', 'skipped', 'failed')) = (finished_at IS NOT NULL))
);
CREATE INDEX groups_pending_by_model ON trainq.groups (model, id) WHERE state = 'pending';
CREATE INDEX groups_claimed_by_lease ON trainq.groups (lease_expires_at) WHERE state = 'claimed';
CREATE INDEX groups_by_claim_token ON trainq.groups (claim_token) WHERE claim_token IS NOT NULL;
CREATE INDEX groups_by_model_state ON trainq.groups (model, state);

COMMENT ON TABLE trainq.groups IS
  'One row per submitted group (the rollouts of one prompt). Producers INSERT model, trajectories, policy_version, metadata; the rest is the queue''s.';
COMMENT ON COLUMN trainq.groups.id IS 'uuid v7, assigned by the database; returned by INSERT ... RETURNING id and trainq.submit_group.';
COMMENT ON COLUMN trainq.groups.model IS 'Producer-written: the model name (trainq.models.name) the group trains. Unknown names: SQLSTATE TQ001.';
COMMENT ON COLUMN trainq.groups.policy_version IS 'Producer-written: the checkpoint step the rollouts were sampled from; NULL = unknown. Must be 0..current_step.';
COMMENT ON COLUMN trainq.groups.trajectories IS
  'Producer-written: a non-empty JSON array of trajectories, each {"messages": [...], "tools": [...], "reward": r, "metrics": {}, "metadata": {}} '
  'or {"prompt_ids": [...], "completion_ids": [...], "logprobs": [...], "reward": r}. Validated on insert (docs/sql-api.md).';
COMMENT ON COLUMN trainq.groups.metadata IS 'Producer-written: any JSON object, kept with the group (e.g. scenario id, sampler settings).';
COMMENT ON COLUMN trainq.groups.submitted_by IS 'Role that inserted the group (current_user); a producer sees only its own groups.';
COMMENT ON COLUMN trainq.groups.state IS 'pending -> claimed -> trained | skipped | failed.';
COMMENT ON COLUMN trainq.groups.skip_reason IS 'Why the group was skipped (set exactly when state = skipped).';
COMMENT ON COLUMN trainq.groups.skip_std IS 'The group''s own reward std as the worker saw it when it skipped the group.';
COMMENT ON COLUMN trainq.groups.skip_detail IS 'Free text from the worker on why the group was skipped.';
COMMENT ON COLUMN trainq.groups.reward_count IS 'Number of trajectories (rewards) in the group, computed on insert.';
COMMENT ON COLUMN trainq.groups.reward_mean IS 'Mean reward of the group, computed on insert.';
COMMENT ON COLUMN trainq.groups.reward_std IS 'Population standard deviation of the group''s rewards, computed on insert.';
COMMENT ON COLUMN trainq.groups.reward_distinct IS 'Number of distinct reward values in the group, computed on insert.';
COMMENT ON COLUMN trainq.groups.payload_bytes IS 'jsonb size of trajectories in bytes, computed on insert.';
COMMENT ON COLUMN trainq.groups.claim_token IS 'Token of the claim holding the group; every worker write is fenced on it.';
COMMENT ON COLUMN trainq.groups.claimed_by IS 'Worker id of the current or last claim.';
COMMENT ON COLUMN trainq.groups.lease_expires_at IS 'When the current claim lapses unless extended; the rescuer then returns the group to pending.';
COMMENT ON COLUMN trainq.groups.attempts IS 'Claims of this group that ended without a result (lease expired or released); failed at max_attempts.';
COMMENT ON COLUMN trainq.groups.step IS 'The optimizer step that trained the group.';
COMMENT ON COLUMN trainq.groups.error IS 'Why the group failed (or why its last attempt did).';
COMMENT ON COLUMN trainq.groups.created_at IS 'Submission time.';
COMMENT ON COLUMN trainq.groups.finished_at IS 'When the group reached trained, skipped or failed.';

CREATE VIEW trainq.trajectories AS
SELECT g.id AS group_id,
       (t.ordinality - 1)::integer AS index,
       (t.value ->> 'reward')::double precision AS reward,
       t.value AS trajectory
FROM trainq.groups g
CROSS JOIN LATERAL jsonb_array_elements(g.trajectories) WITH ORDINALITY AS t (value, ordinality);
COMMENT ON VIEW trainq.trajectories IS 'One row per trajectory (group_id, index from 0, reward, the trajectory object), read from trainq.groups.';

CREATE TABLE trainq.steps (
    model                text        NOT NULL REFERENCES trainq.models (name),
    step                 bigint      NOT NULL,
    worker_id            text        NOT NULL,
    async_weight_syncing boolean     NOT NULL,
    started_at           timestamptz NOT NULL,
    finished_at          timestamptz NOT NULL,
    groups_claimed       integer     NOT NULL,
    groups_trained       integer     NOT NULL,
    groups_skipped       jsonb       NOT NULL DEFAULT '{}',
    trajectories         integer     NOT NULL,
    tokens               bigint      NOT NULL,
    loss                 double precision,
    loss_parts           jsonb       NOT NULL DEFAULT '{}',
    grad_norm            double precision,
    learning_rate        double precision,
    reward_mean          double precision,
    reward_std_mean      double precision,
    policy_lag_min       bigint,
    policy_lag_max       bigint,
    timings              jsonb       NOT NULL DEFAULT '{}',
    devices              jsonb       NOT NULL DEFAULT '[]',
    checkpoint_uri       text,
    checkpoint_sha256    text,
    PRIMARY KEY (model, step),
    CONSTRAINT steps_step_positive CHECK (step > 0),
    CONSTRAINT steps_finished_after_started CHECK (finished_at >= started_at),
    CONSTRAINT steps_counts_not_negative CHECK (groups_claimed >= 0 AND groups_trained >= 0 AND trajectories >= 0 AND tokens >= 0),
    CONSTRAINT steps_trained_within_claimed CHECK (groups_trained <= groups_claimed),
    CONSTRAINT steps_policy_lag_ordered CHECK (policy_lag_min <= policy_lag_max),
    CONSTRAINT steps_json_shapes CHECK (jsonb_typeof(groups_skipped) = 'object' AND jsonb_typeof(loss_parts) = 'object' AND jsonb_typeof(timings) = 'object' AND jsonb_typeof(devices) = 'array')
);
COMMENT ON TABLE trainq.steps IS 'One row per committed optimizer step of a model.';
COMMENT ON COLUMN trainq.steps.groups_skipped IS 'Skipped groups counted by reason, e.g. {"zero_variance": 3, "stale": 1}.';
COMMENT ON COLUMN trainq.steps.reward_std_mean IS 'Mean over trained groups of each group''s own reward std.';
COMMENT ON COLUMN trainq.steps.policy_lag_min IS 'Smallest step - policy_version among trained groups.';
COMMENT ON COLUMN trainq.steps.timings IS 'Seconds per phase, e.g. {"claim": 0.01, "train": 12.3, "upload": 1.2}.';

CREATE TABLE trainq.checkpoints (
    model      text                     NOT NULL,
    step       bigint                   NOT NULL,
    uri        text                     NOT NULL,
    format     trainq.checkpoint_format NOT NULL,
    bytes      bigint                   NOT NULL,
    sha256     text                     NOT NULL,
    manifest   jsonb                    NOT NULL DEFAULT '{}',
    created_at timestamptz              NOT NULL DEFAULT now(),
    PRIMARY KEY (model, step),
    FOREIGN KEY (model, step) REFERENCES trainq.steps (model, step),
    CONSTRAINT checkpoints_bytes_not_negative CHECK (bytes >= 0),
    CONSTRAINT checkpoints_sha256_is_hex CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    CONSTRAINT checkpoints_uri_not_empty CHECK (uri <> '')
);
COMMENT ON TABLE trainq.checkpoints IS 'Uploaded weights of a step: URI of the checkpoint directory, format, size, sha256 of manifest.json.';

CREATE TABLE trainq.workers (
    id           text        PRIMARY KEY,
    host         text        NOT NULL,
    model        text        REFERENCES trainq.models (name),
    devices      jsonb       NOT NULL DEFAULT '[]',
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT workers_devices_is_array CHECK (jsonb_typeof(devices) = 'array')
);
COMMENT ON TABLE trainq.workers IS 'Running (or recently running) workers and their last heartbeat.';
