//! The NCCL rendezvous through PostgreSQL: rank 0 publishes its unique id, the other ranks wait
//! for it and join; a stale rendezvous (expired, or already joined by the rank) is never reused.

mod common;

use std::time::Duration;

use chrono::Utc;
use common::db::TestDb;
use trainq_queue::db::{get_rendezvous, join_rendezvous, publish_unique_id, wait_for_unique_id, PublishParams};

const MODEL: &str = "m1";
/// Long enough for a waiting rank to see a publish on a loaded machine.
const WAIT: Duration = Duration::from_secs(20);
/// How long a rank waits when the test expects it to find nothing.
const SHORT_WAIT: Duration = Duration::from_millis(400);

fn unique_id(fill: u8) -> String {
    hex::encode([fill; 128])
}

fn params(generation: i64, world_size: i32, id: &str) -> PublishParams<'_> {
    PublishParams { model: MODEL, generation, world_size, nccl_unique_id: id, ttl: Duration::from_secs(60), now: None }
}

async fn db_with_model() -> TestDb {
    let db = TestDb::new().await;
    db.create_model(MODEL).await;
    db
}

#[tokio::test]
async fn ranks_waiting_before_rank_zero_publishes_all_receive_its_id() {
    let db = db_with_model().await;
    let world_size = 4;
    let waiters: Vec<_> = (1..world_size)
        .map(|rank| {
            let pool = db.pool.clone();
            tokio::spawn(async move { wait_for_unique_id(&pool, MODEL, 3, rank, world_size, WAIT).await })
        })
        .collect();
    let id = unique_id(0xab);
    publish_unique_id(&db.pool, &params(3, world_size, &id)).await.unwrap();
    for waiter in waiters {
        assert_eq!(waiter.await.unwrap().unwrap(), id);
    }
    let mut joined = get_rendezvous(&db.pool, MODEL, 3).await.unwrap().unwrap().joined_ranks;
    joined.sort_unstable();
    assert_eq!(joined, vec![0, 1, 2, 3]);
}

#[tokio::test]
async fn an_expired_rendezvous_is_not_joined_and_a_fresh_publish_replaces_it() {
    let db = db_with_model().await;
    let old = unique_id(0x01);
    let an_hour_ago = Utc::now() - chrono::Duration::hours(1);
    publish_unique_id(&db.pool, &PublishParams { now: Some(an_hour_ago), ..params(5, 2, &old) }).await.unwrap();
    assert!(wait_for_unique_id(&db.pool, MODEL, 5, 1, 2, SHORT_WAIT).await.is_err(), "an expired id was handed out");
    assert_eq!(get_rendezvous(&db.pool, MODEL, 5).await.unwrap().unwrap().joined_ranks, vec![0]);

    let fresh = unique_id(0x02);
    publish_unique_id(&db.pool, &params(5, 2, &fresh)).await.unwrap();
    assert_eq!(wait_for_unique_id(&db.pool, MODEL, 5, 1, 2, WAIT).await.unwrap(), fresh);
}

#[tokio::test]
async fn a_rank_restarted_after_joining_waits_for_the_new_id_instead_of_the_old_one() {
    let db = db_with_model().await;
    let first = unique_id(0x10);
    publish_unique_id(&db.pool, &params(7, 3, &first)).await.unwrap();
    assert_eq!(join_rendezvous(&db.pool, MODEL, 7, 2, 3, None).await.unwrap(), Some(first.clone()));
    // The group crashed; rank 2 comes back before rank 0 has published again.
    assert_eq!(join_rendezvous(&db.pool, MODEL, 7, 2, 3, None).await.unwrap(), None);
    assert!(wait_for_unique_id(&db.pool, MODEL, 7, 2, 3, SHORT_WAIT).await.is_err());

    let second = unique_id(0x20);
    let republished = publish_unique_id(&db.pool, &params(7, 3, &second)).await.unwrap();
    assert_eq!(republished.joined_ranks, vec![0], "a new publish starts a new group");
    assert_eq!(wait_for_unique_id(&db.pool, MODEL, 7, 2, 3, WAIT).await.unwrap(), second);
}

#[tokio::test]
async fn a_rank_expecting_another_world_size_is_refused() {
    let db = db_with_model().await;
    publish_unique_id(&db.pool, &params(1, 2, &unique_id(0x33))).await.unwrap();
    let err = join_rendezvous(&db.pool, MODEL, 1, 1, 4, None).await.unwrap_err();
    assert!(err.to_string().contains("world size 2"), "{err}");
    assert!(join_rendezvous(&db.pool, MODEL, 1, 0, 2, None).await.is_err(), "rank 0 publishes, it never joins");
}

#[tokio::test]
async fn the_database_refuses_an_id_that_is_not_128_bytes_of_hex() {
    let db = db_with_model().await;
    let err = publish_unique_id(&db.pool, &params(1, 2, "abc")).await.unwrap_err();
    assert!(format!("{err:?}").contains("rendezvous_unique_id_is_128_bytes_hex"), "{err:?}");
}

#[tokio::test]
async fn publishing_clears_the_models_expired_rendezvous() {
    let db = db_with_model().await;
    let long_ago = Utc::now() - chrono::Duration::days(1);
    publish_unique_id(&db.pool, &PublishParams { now: Some(long_ago), ..params(1, 2, &unique_id(1)) }).await.unwrap();
    publish_unique_id(&db.pool, &params(2, 2, &unique_id(2))).await.unwrap();
    assert!(get_rendezvous(&db.pool, MODEL, 1).await.unwrap().is_none());
    assert!(get_rendezvous(&db.pool, MODEL, 2).await.unwrap().is_some());
}
