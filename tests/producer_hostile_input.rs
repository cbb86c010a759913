//! Hostile producer input the worker could not use is refused at insert, with a stable SQLSTATE
//! and a message naming the row, trajectory and field: JSON numbers beyond a double anywhere,
//! nesting deeper than 64 levels, token ids beyond the model's vocabulary, rewards whose
//! statistics overflow or underflow a double; the payload limit measures the uncompressed size
//! (also through the COPY-into-a-temporary-table route); a multi-row INSERT or COPY names the
//! refused row.

mod common;

use common::db::{chat_group, TestDb, TestRole};
use sqlx::postgres::PgDatabaseError;
use sqlx::PgPool;
use trainq_queue::db::{self, sqlstate};

/// Model `m1` (vocab_size 100, 1 MiB payload limit) and `open` (vocabulary unknown).
async fn setup() -> TestDb {
    let db = TestDb::new().await;
    let mut model = db::NewModel::new("m1", "/base");
    model.vocab_size = Some(100);
    model.max_group_bytes = 1 << 20;
    db::create_model(&db.pool, &model).await.unwrap();
    db::create_model(&db.pool, &db::NewModel::new("open", "/base")).await.unwrap();
    db
}

/// Inserts one group given as JSON text (serde_json cannot even hold some of these numbers).
async fn insert_text(pool: &PgPool, model: &str, trajectories: &str, metadata: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO trainq.groups (model, trajectories, metadata) VALUES ($1, $2::jsonb, $3::jsonb)")
        .bind(model)
        .bind(trajectories)
        .bind(metadata)
        .execute(pool)
        .await
        .map(drop)
}

/// Asserts `result` is refused with `code` and a message containing `message`; returns the error.
fn assert_refused(result: Result<(), sqlx::Error>, code: &str, message: &str) -> Box<PgDatabaseError> {
    let err = result.expect_err(message);
    let db_err = err.into_database_error().expect("a database error");
    let pg: Box<PgDatabaseError> = db_err.downcast();
    assert_eq!(pg.code(), code, "{}", pg.message());
    assert!(pg.message().contains(message), "got {:?}, want {message:?}", pg.message());
    pg
}

const TOKENS: &str = r#"{"prompt_ids": [1, 2], "completion_ids": [3, 4], "reward": 1}"#;

fn chat_with(extra: &str) -> String {
    format!(
        r#"[{{"messages": [{{"role": "user", "content": "2+2?"}}, {{"role": "assistant", "content": "4"{extra}}}], "reward": 1}}, {TOKENS}]"#
    )
}

#[tokio::test]
async fn numbers_beyond_a_double_are_refused_wherever_they_are_with_the_field_named() {
    let db = setup().await;
    let cases = [
        (
            format!("[{TOKENS}]"),
            r#"{"a": {"b": [1, 1e400]}}"#,
            r#"field "metadata.a.b[1]" holds a number beyond the range of a double"#,
        ),
        (
            format!(
                r#"[{TOKENS}, {{"prompt_ids": [1], "completion_ids": [2], "reward": 0, "metrics": {{"score": -1e309}}}}]"#
            ),
            "{}",
            r#"trajectory 1: field "metrics.score" holds a number beyond the range of a double"#,
        ),
        (
            r#"[{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-1e400], "reward": 1}]"#.to_string(),
            "{}",
            r#"trajectory 0: field "logprobs[0]" holds a number"#,
        ),
        (
            chat_with(r#", "token_ids": [5], "logprobs": [-2e308]"#),
            "{}",
            r#"trajectory 0: field "messages[1].logprobs[0]" holds a number"#,
        ),
        (
            format!(
                r#"[{TOKENS}, {{"prompt_ids": [1], "completion_ids": [2], "reward": 0, "metadata": {{"seed": 123456789e400}}}}]"#
            ),
            "{}",
            r#"trajectory 1: field "metadata.seed""#,
        ),
    ];
    for (trajectories, metadata, message) in &cases {
        assert_refused(
            insert_text(&db.pool, "m1", trajectories, metadata).await,
            sqlstate::NUMBER_OUT_OF_RANGE,
            message,
        );
    }
    // The largest double and the smallest subnormal are fine (serde_json reads both).
    let edge = r#"{"big": 1.7976931348623157e308, "tiny": -5e-324, "tinier": 1e-400}"#;
    insert_text(&db.pool, "m1", &format!("[{TOKENS}]"), edge).await.unwrap();
    assert_eq!(db.group_count().await, 1);
}

#[tokio::test]
async fn nesting_deeper_than_64_levels_is_refused_and_64_is_accepted() {
    let db = setup().await;
    let nested = |levels: usize| format!("{}1{}", "[".repeat(levels), "]".repeat(levels));
    let deep_object = |levels: usize| format!("{}1{}", r#"{"a": "#.repeat(levels), "}".repeat(levels));
    let trajectories = format!("[{TOKENS}]");
    // Group metadata: 200 and 10,000 levels (the issue's), and 65 below the column.
    for metadata in [deep_object(200), deep_object(10_000), format!(r#"{{"a": {}}}"#, nested(64))] {
        assert_refused(
            insert_text(&db.pool, "m1", &trajectories, &metadata).await,
            sqlstate::NESTED_TOO_DEEP,
            r#"field "metadata.a"#,
        );
    }
    // A trajectory's field: [ trajectory { "metadata": { "x": 63 arrays of 1 } } ] puts the 1 at level 66.
    let too_deep =
        format!(r#"[{{"prompt_ids": [1], "completion_ids": [2], "reward": 1, "metadata": {{"x": {}}}}}]"#, nested(63));
    assert_refused(
        insert_text(&db.pool, "m1", &too_deep, "{}").await,
        sqlstate::NESTED_TOO_DEEP,
        r#"trajectory 0: field "metadata.x[0][0]"#,
    );
    // 64 levels below each column are accepted.
    insert_text(&db.pool, "m1", &trajectories, &format!(r#"{{"a": {}}}"#, nested(63))).await.unwrap();
    let ok =
        format!(r#"[{{"prompt_ids": [1], "completion_ids": [2], "reward": 1, "metadata": {{"x": {}}}}}]"#, nested(61));
    insert_text(&db.pool, "m1", &ok, "{}").await.unwrap();
    assert_eq!(db.group_count().await, 2);
}

#[tokio::test]
async fn token_ids_beyond_the_models_vocab_size_are_refused_and_an_unknown_vocabulary_is_not_checked() {
    let db = setup().await;
    let beyond = r#"[{"prompt_ids": [1, 2], "completion_ids": [3, 100], "reward": 1}]"#;
    assert_refused(
        insert_text(&db.pool, "m1", beyond, "{}").await,
        sqlstate::TOKEN_ID_BEYOND_VOCAB,
        r#"trajectory 0: field "completion_ids" holds index 1 (100), beyond model m1's vocab_size 100"#,
    );
    let prompt = r#"[{"prompt_ids": [151936], "completion_ids": [3], "reward": 1}]"#;
    assert_refused(
        insert_text(&db.pool, "m1", prompt, "{}").await,
        sqlstate::TOKEN_ID_BEYOND_VOCAB,
        r#"field "prompt_ids" holds index 0 (151936)"#,
    );
    let sampler = chat_with(r#", "token_ids": [5, 99, 100], "logprobs": [-1, -1, -1]"#);
    assert_refused(
        insert_text(&db.pool, "m1", &sampler, "{}").await,
        sqlstate::TOKEN_ID_BEYOND_VOCAB,
        r#"trajectory 0, message 1: field "token_ids" holds index 2 (100), beyond model m1's vocab_size 100"#,
    );
    assert_eq!(db.group_count().await, 0);
    // Ids below the vocabulary pass; a model whose vocabulary is unknown takes any id.
    insert_text(&db.pool, "m1", &chat_with(r#", "token_ids": [0, 99], "logprobs": [-1, -1]"#), "{}").await.unwrap();
    insert_text(&db.pool, "open", beyond, "{}").await.unwrap();
    assert_eq!(db.group_count().await, 2);
}

#[tokio::test]
async fn reward_overflow_and_underflow_are_refused_naming_the_trajectory_and_field() {
    let db = setup().await;
    let rewards = |a: &str, b: &str| {
        format!(
            r#"[{{"prompt_ids": [1], "completion_ids": [2], "reward": {a}}}, {{"prompt_ids": [1], "completion_ids": [2], "reward": {b}}}]"#
        )
    };
    let refused = [
        (
            rewards("1e200", "0"),
            r#"trajectory 0: field "reward" must be finite and at most 1e100 in magnitude, got about 1e200"#,
        ),
        (rewards("0", "-1e101"), r#"trajectory 1: field "reward" must be finite and at most 1e100 in magnitude"#),
        (
            rewards("0", "1e-400"),
            r#"trajectory 1: field "reward" must be 0 or at least 1e-100 in magnitude (a double underflows below), got about 1e-400"#,
        ),
        (rewards("1e-200", "1"), r#"trajectory 0: field "reward" must be 0 or at least 1e-100 in magnitude"#),
    ];
    for (trajectories, message) in &refused {
        assert_refused(insert_text(&db.pool, "m1", trajectories, "{}").await, sqlstate::REWARD_NOT_FINITE, message);
    }
    // The edges are accepted, with statistics a double holds.
    for (a, b) in [("1e100", "-1e100"), ("1e-100", "0")] {
        insert_text(&db.pool, "m1", &rewards(a, b), "{}").await.unwrap();
    }
    let stds: Vec<f64> =
        sqlx::query_scalar("SELECT reward_std FROM trainq.groups ORDER BY id").fetch_all(&db.pool).await.unwrap();
    assert_eq!(stds.len(), 2);
    for (std, want) in stds.iter().zip([1e100, 5e-101]) {
        assert!(((std - want) / want).abs() < 1e-12, "std {std}, want {want}");
    }
}

#[tokio::test]
async fn the_payload_limit_measures_the_uncompressed_size_through_the_copy_into_a_temporary_table_route() {
    let db = setup().await;
    let alice = TestRole::new(&db, "alice", "trainq_producer").await;
    let pool = db.connect_as(Some(&alice.name), 1).await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("CREATE TEMPORARY TABLE staged (model text, trajectories jsonb)").execute(&mut *conn).await.unwrap();
    // 4 MB of one repeated letter: it compresses to a few tens of KB in the temporary table.
    let huge = serde_json::json!([{"messages": [{"role": "user", "content": "x".repeat(4 << 20)},
                                                 {"role": "assistant", "content": "y"}], "reward": 1}]);
    let mut copy = conn.copy_in_raw("COPY staged (model, trajectories) FROM STDIN").await.unwrap();
    copy.send(format!("m1\t{huge}\n").as_bytes()).await.unwrap();
    copy.finish().await.unwrap();
    let stored: i32 =
        sqlx::query_scalar("SELECT pg_column_size(trajectories) FROM staged").fetch_one(&mut *conn).await.unwrap();
    assert!(stored < 1 << 20, "compressed to {stored} bytes, under the 1 MiB limit");
    let refused = sqlx::query("INSERT INTO trainq.groups (model, trajectories) SELECT model, trajectories FROM staged")
        .execute(&mut *conn)
        .await
        .map(drop);
    assert_refused(refused, sqlstate::PAYLOAD_TOO_LARGE, "more than model m1's limit of 1048576");
    // A small group takes the same route, and its recorded size is its uncompressed size.
    sqlx::query("TRUNCATE staged").execute(&mut *conn).await.unwrap();
    let small = serde_json::json!([{"messages": [{"role": "user", "content": "z".repeat(100_000)},
                                                  {"role": "assistant", "content": "y"}], "reward": 1}]);
    sqlx::query("INSERT INTO staged VALUES ('m1', $1)").bind(&small).execute(&mut *conn).await.unwrap();
    sqlx::query("INSERT INTO trainq.groups (model, trajectories) SELECT model, trajectories FROM staged")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    let bytes: i32 = sqlx::query_scalar("SELECT payload_bytes FROM trainq.groups").fetch_one(&db.pool).await.unwrap();
    assert!(bytes > 100_000, "payload_bytes {bytes} is the uncompressed size");
}

#[tokio::test]
async fn a_multi_row_insert_and_a_copy_name_the_refused_row() {
    let db = setup().await;
    let good = chat_group(&[0.0, 1.0]);
    let bad = serde_json::json!([{"reward": 1}]);
    let err = sqlx::query("INSERT INTO trainq.groups (model, trajectories) VALUES ('m1', $1), ('m1', $1), ('m1', $2)")
        .bind(&good)
        .bind(&bad)
        .execute(&db.pool)
        .await
        .map(drop);
    let pg = assert_refused(err, sqlstate::MISSING_CONTENT, "row 3: trajectory 0: field \"messages\" is missing");
    assert_eq!(pg.detail(), Some("row 3 of the statement (counting from 1)"));
    // A single-row statement keeps the plain message; its detail still says row 1.
    let single = sqlx::query("INSERT INTO trainq.groups (model, trajectories) VALUES ('m1', $1)")
        .bind(&bad)
        .execute(&db.pool)
        .await
        .map(drop);
    let pg = assert_refused(single, sqlstate::MISSING_CONTENT, "trajectory 0: field \"messages\" is missing");
    assert!(pg.message().starts_with("trajectory 0"), "{}", pg.message());
    assert_eq!(pg.detail(), Some("row 1 of the statement (counting from 1)"));
    // COPY counts its lines the same way; each statement counts from 1 again.
    let mut conn = db.pool.acquire().await.unwrap();
    let mut copy = conn.copy_in_raw("COPY trainq.groups (model, trajectories) FROM STDIN").await.unwrap();
    copy.send(format!("m1\t{good}\nm1\t{good}\nm1\t{}\n", serde_json::json!([{"reward": "x"}])).as_bytes())
        .await
        .unwrap();
    let pg = assert_refused(
        copy.finish().await.map(drop),
        sqlstate::REWARD_NOT_NUMBER,
        "row 3: trajectory 0: field \"reward\" must be a number",
    );
    assert_eq!(pg.detail(), Some("row 3 of the statement (counting from 1)"));
    let ahead = sqlx::query(
        "INSERT INTO trainq.groups (model, trajectories, policy_version) VALUES ('m1', $1, 0), ('m1', $1, 7)",
    )
    .bind(&good)
    .execute(&mut *conn)
    .await
    .map(drop);
    assert_refused(ahead, sqlstate::POLICY_VERSION_AHEAD, "row 2: field \"policy_version\" 7 is ahead");
    drop(conn);
    assert_eq!(db.group_count().await, 0);
}

#[tokio::test]
async fn typical_groups_with_sampler_tokens_still_take_the_fast_path() {
    let db = setup().await;
    let group = serde_json::json!([{
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "yo", "token_ids": [1, 2, 99], "logprobs": [-0.1, -2.5, -1e-9]}],
        "reward": 0.5, "metrics": {"turns": 1, "score": 1e300}, "metadata": {"nested": [[[{"deep": [1, 2]}]]]}
    }]);
    for vocab in [Some(100), None] {
        let flagged: bool = sqlx::query_scalar("SELECT trainq.group_may_be_invalid($1, $2)")
            .bind(&group)
            .bind(vocab)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert!(!flagged, "vocab {vocab:?}");
    }
    let flagged: bool = sqlx::query_scalar("SELECT trainq.group_may_be_invalid($1, 99)")
        .bind(&group)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(flagged, "id 99 is beyond a vocabulary of 99");
}
