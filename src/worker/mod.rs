//! The daemon loop: claim, filter, train, checkpoint, commit; graceful shutdown.
