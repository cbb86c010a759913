-- Why this migration exists: data-parallel training over NCCL needs every rank of a group to hold
-- the same 128-byte NCCL unique id before any of them can create its communicator. Rank 0 makes
-- the id; the other ranks may run on other hosts, and the one thing every trainq process can
-- already reach is this database. So rank 0 publishes the id here (hex) for its model and
-- generation, and the other ranks poll until they can join it.
--
-- A rendezvous is stale when it has expired or when the joining rank already joined it (the
-- group it belonged to has crashed and restarted): neither is ever handed out again, so a rank
-- can never wait on an NCCL group that no longer exists. Rank 0 publishing again for the same
-- model and generation replaces the row with a fresh id.

CREATE TABLE trainq.rendezvous (
    model          text        NOT NULL REFERENCES trainq.models (name) ON DELETE CASCADE,
    generation     bigint      NOT NULL,
    world_size     integer     NOT NULL,
    nccl_unique_id text        NOT NULL,
    joined_ranks   integer[]   NOT NULL DEFAULT '{0}',
    created_at     timestamptz NOT NULL DEFAULT now(),
    expires_at     timestamptz NOT NULL,
    PRIMARY KEY (model, generation),
    CONSTRAINT rendezvous_world_size_positive CHECK (world_size >= 1),
    CONSTRAINT rendezvous_unique_id_is_128_bytes_hex CHECK (length(nccl_unique_id) = 256 AND nccl_unique_id ~ '^[0-9a-f]+$'),
    CONSTRAINT rendezvous_joined_ranks_in_world CHECK (
        0 = ANY (joined_ranks) AND 0 <= ALL (joined_ranks) AND world_size > ALL (joined_ranks)
    ),
    CONSTRAINT rendezvous_expires_after_created CHECK (expires_at > created_at)
);
COMMENT ON TABLE trainq.rendezvous IS
  'NCCL unique ids published by rank 0 of a data-parallel group, one per (model, generation), joined by the other ranks.';
COMMENT ON COLUMN trainq.rendezvous.model IS 'Model the group trains.';
COMMENT ON COLUMN trainq.rendezvous.generation IS
  'Which start of the group this is; every rank passes the same number (e.g. the model''s current_step when the group starts).';
COMMENT ON COLUMN trainq.rendezvous.world_size IS 'Number of ranks in the group, over all hosts.';
COMMENT ON COLUMN trainq.rendezvous.nccl_unique_id IS 'Rank 0''s ncclUniqueId: 128 bytes as 256 lower-case hex digits.';
COMMENT ON COLUMN trainq.rendezvous.joined_ranks IS 'Ranks that have taken the id (rank 0 from the start); a rank never takes it twice.';
COMMENT ON COLUMN trainq.rendezvous.created_at IS 'When rank 0 published the id.';
COMMENT ON COLUMN trainq.rendezvous.expires_at IS 'After this the id is stale and no rank may join it.';

GRANT SELECT, INSERT, UPDATE, DELETE ON trainq.rendezvous TO trainq_worker;
