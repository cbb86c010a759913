//! The producer contract: the database refuses bad groups in the same statement, storing nothing,
//! with a message naming the trajectory index and field and a stable `TQ…` SQLSTATE; good groups
//! (chat with tools, pre-tokenized, multi-row INSERT, COPY) go in with their reward statistics.

mod common;

use common::db::{chat_group, chat_trajectory, TestDb};
use serde_json::{json, Value};
use trainq_queue::db::{self, sqlstate};
use trainq_queue::StepNumber;

/// A model with small limits (4 trajectories, 4 KiB) and current step 2.
async fn setup() -> TestDb {
    let db = TestDb::new().await;
    let mut model = db::NewModel::new("m1", "/base");
    model.max_group_trajectories = 4;
    model.max_group_bytes = 4096;
    db::create_model(&db.pool, &model).await.unwrap();
    sqlx::query("UPDATE trainq.models SET current_step = 2").execute(&db.pool).await.unwrap();
    db
}

fn chat(messages: Value) -> Value {
    json!([{"messages": messages, "reward": 1.0}])
}

fn assistant(extra: Value) -> Value {
    let mut msg = json!({"role": "assistant", "content": "4"});
    msg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    chat(json!([{"role": "user", "content": "2+2?"}, msg]))
}

fn tokens(extra: Value) -> Value {
    let mut t = json!({"prompt_ids": [1, 2], "completion_ids": [3, 4], "reward": 0.5});
    t.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    json!([t])
}

struct Case {
    name: &'static str,
    model: &'static str,
    trajectories: Value,
    policy_version: Option<i64>,
    metadata: Value,
    code: &'static str,
    message: &'static str,
}

fn case(name: &'static str, trajectories: Value, code: &'static str, message: &'static str) -> Case {
    Case { name, model: "m1", trajectories, policy_version: None, metadata: json!({}), code, message }
}

fn cases() -> Vec<Case> {
    let two = |a: Value| json!([chat_trajectory(0.0), a]);
    vec![
        Case { model: "nope", ..case("unknown model", chat_group(&[1.0]), sqlstate::UNKNOWN_MODEL, "unknown model 'nope'") },
        case("empty group", json!([]), sqlstate::EMPTY_GROUP, "field \"trajectories\" is empty"),
        case("trajectories not an array", json!({"reward": 1}), sqlstate::EMPTY_GROUP, "must be a JSON array of trajectories, got object"),
        case("trajectory not an object", two(json!(3)), sqlstate::TRAJECTORY_NOT_OBJECT, "trajectory 1: must be a JSON object, got number"),
        case("reward missing", two(json!({"messages": []})), sqlstate::REWARD_NOT_NUMBER, "trajectory 1: field \"reward\" is missing"),
        case("reward null", two(json!({"reward": null})), sqlstate::REWARD_NOT_NUMBER, "trajectory 1: field \"reward\" is missing"),
        case("reward a string", two(json!({"reward": "high"})), sqlstate::REWARD_NOT_NUMBER, "trajectory 1: field \"reward\" must be a number, got \"high\""),
        case("reward a boolean", two(json!({"reward": true})), sqlstate::REWARD_NOT_NUMBER, "trajectory 1: field \"reward\" must be a number, got true"),
        case("reward NaN", two(json!({"reward": "NaN"})), sqlstate::REWARD_NOT_FINITE, "trajectory 1: field \"reward\" must be finite, got \"NaN\""),
        case("reward -Infinity", two(json!({"reward": "-Infinity"})), sqlstate::REWARD_NOT_FINITE, "trajectory 1: field \"reward\" must be finite"),
        case("messages missing", json!([{"reward": 1}]), sqlstate::MISSING_CONTENT, "trajectory 0: field \"messages\" is missing"),
        case("messages empty", chat(json!([])), sqlstate::MISSING_CONTENT, "trajectory 0: field \"messages\" must be a non-empty array"),
        case("messages not an array", chat(json!("hi")), sqlstate::MISSING_CONTENT, "trajectory 0: field \"messages\" must be a non-empty array, got string"),
        case("messages and token ids both", json!([{"messages": [], "prompt_ids": [1], "reward": 1}]), sqlstate::MISSING_CONTENT, "give either \"messages\" or \"prompt_ids\"/\"completion_ids\""),
        case("message not an object", chat(json!(["hi"])), sqlstate::MESSAGE_MALFORMED, "trajectory 0, message 0: must be a JSON object, got string"),
        case("unknown role", chat(json!([{"role": "robot", "content": "x"}])), sqlstate::MESSAGE_MALFORMED, "trajectory 0, message 0: field \"role\" must be one of system, developer, user, assistant, tool, got \"robot\""),
        case("role missing", chat(json!([{"content": "x"}])), sqlstate::MESSAGE_MALFORMED, "trajectory 0, message 0: field \"role\" must be one of"),
        case("content a number", chat(json!([{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}])), sqlstate::CONTENT_MALFORMED, "trajectory 0, message 0: field \"content\" must be a string or an array of parts, got number"),
        case("content missing", chat(json!([{"role": "user"}, {"role": "assistant", "content": "x"}])), sqlstate::CONTENT_MALFORMED, "trajectory 0, message 0: field \"content\" is missing (user message)"),
        case("content part without type", chat(json!([{"role": "user", "content": [{"text": "x"}]}, {"role": "assistant", "content": "x"}])), sqlstate::CONTENT_MALFORMED, "field \"content\" parts must be objects with a string \"type\""),
        case("no assistant turn", chat(json!([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])), sqlstate::NO_ASSISTANT_TURN, "trajectory 0: field \"messages\" has no assistant turn"),
        case("tool_calls not an array", assistant(json!({"tool_calls": {"id": 1}})), sqlstate::TOOL_CALLS_MALFORMED, "trajectory 0, message 1: field \"tool_calls\" must be an array on an assistant message"),
        case("tool call without function name", assistant(json!({"tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]})), sqlstate::TOOL_CALLS_MALFORMED, "trajectory 0, message 1, tool call 0: field \"function.name\" must be a non-empty string"),
        case("tool call arguments a number", assistant(json!({"tool_calls": [{"function": {"name": "f", "arguments": 3}}]})), sqlstate::TOOL_CALLS_MALFORMED, "trajectory 0, message 1, tool call 0: field \"function.arguments\" must be a JSON string or object"),
        case("tool call of another type", assistant(json!({"tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}]})), sqlstate::TOOL_CALLS_MALFORMED, "tool call 0: field \"type\" must be \"function\""),
        case("tool_calls on a user message", chat(json!([{"role": "user", "content": "x", "tool_calls": []}, {"role": "assistant", "content": "y"}])), sqlstate::TOOL_CALLS_MALFORMED, "trajectory 0, message 0: field \"tool_calls\" must be an array on an assistant message"),
        case("negative token id", assistant(json!({"token_ids": [5, -1]})), sqlstate::TOKEN_IDS_MALFORMED, "trajectory 0, message 1: field \"token_ids\" must hold non-negative integers, index 1 (-1) is not"),
        case("fractional token id", tokens(json!({"completion_ids": [3, 4.5]})), sqlstate::TOKEN_IDS_MALFORMED, "trajectory 0: field \"completion_ids\" must hold non-negative integers, index 1 (4.5) is not"),
        case("string token id", tokens(json!({"prompt_ids": ["1"]})), sqlstate::TOKEN_IDS_MALFORMED, "trajectory 0: field \"prompt_ids\" must hold non-negative integers, index 0 (\"1\") is not"),
        case("token ids not an array", tokens(json!({"prompt_ids": 7})), sqlstate::TOKEN_IDS_MALFORMED, "trajectory 0: field \"prompt_ids\" must be an array of non-negative integers, got number"),
        case("token ids on a user message", chat(json!([{"role": "user", "content": "x", "token_ids": [1]}, {"role": "assistant", "content": "y"}])), sqlstate::TOKEN_IDS_MALFORMED, "only allowed on assistant messages"),
        case("completion ids missing", json!([{"prompt_ids": [1], "reward": 1}]), sqlstate::MISSING_CONTENT, "trajectory 0: field \"completion_ids\" is missing"),
        case("completion ids empty", tokens(json!({"completion_ids": []})), sqlstate::MISSING_CONTENT, "trajectory 0: field \"completion_ids\" must not be empty"),
        case("logprobs shorter than tokens", assistant(json!({"token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2]})), sqlstate::LOGPROBS_LENGTH, "trajectory 0, message 1: field \"logprobs\" has 2 entries but \"token_ids\" has 3"),
        case("logprobs longer than completion", tokens(json!({"logprobs": [-1, -1, -1]})), sqlstate::LOGPROBS_LENGTH, "trajectory 0: field \"logprobs\" has 3 entries but \"completion_ids\" has 2"),
        case("logprobs without token ids", assistant(json!({"logprobs": [-0.1]})), sqlstate::LOGPROBS_LENGTH, "field \"logprobs\" given without \"token_ids\""),
        case("positive logprob", tokens(json!({"logprobs": [-0.5, 0.25]})), sqlstate::LOGPROBS_MALFORMED, "trajectory 0: field \"logprobs\" must hold numbers <= 0, index 1 (0.25) is not"),
        case("string logprob", assistant(json!({"token_ids": [1], "logprobs": ["x"]})), sqlstate::LOGPROBS_MALFORMED, "field \"logprobs\" must hold numbers <= 0, index 0 (\"x\") is not"),
        Case { policy_version: Some(-1), ..case("negative policy_version", chat_group(&[1.0]), sqlstate::POLICY_VERSION_NEGATIVE, "field \"policy_version\" must not be negative, got -1") },
        Case { policy_version: Some(3), ..case("policy_version ahead of the model", chat_group(&[1.0]), sqlstate::POLICY_VERSION_AHEAD, "field \"policy_version\" 3 is ahead of model m1's current step 2") },
        case("too many trajectories", chat_group(&[1.0; 5]), sqlstate::GROUP_TOO_LARGE, "field \"trajectories\" has 5 trajectories, more than model m1's limit of 4"),
        case("payload too large", json!([{"messages": [{"role": "user", "content": "x".repeat(5000)}, {"role": "assistant", "content": "y"}], "reward": 1}]), sqlstate::PAYLOAD_TOO_LARGE, "more than model m1's limit of 4096"),
        Case { metadata: json!([1]), ..case("metadata an array", chat_group(&[1.0]), sqlstate::NOT_AN_OBJECT, "field \"metadata\" must be a JSON object, got array") },
        case("trajectory metrics a list", two(json!({"messages": [], "reward": 1, "metrics": [1]})), sqlstate::NOT_AN_OBJECT, "trajectory 1: field \"metrics\" must be a JSON object"),
        case("tools malformed", json!([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": [{"type": "function"}], "reward": 1}]), sqlstate::TOOLS_MALFORMED, "trajectory 0: field \"tools\" must be an array"),
    ]
}

#[tokio::test]
async fn every_bad_input_is_refused_with_its_sqlstate_and_message_and_nothing_is_stored() {
    let db = setup().await;
    let cases = cases();
    assert!(cases.len() >= 25);
    for c in &cases {
        let err = sqlx::query(
            "INSERT INTO trainq.groups (model, trajectories, policy_version, metadata) VALUES ($1, $2, $3, $4)",
        )
        .bind(c.model)
        .bind(&c.trajectories)
        .bind(c.policy_version)
        .bind(&c.metadata)
        .execute(&db.pool)
        .await
        .expect_err(c.name);
        let db_err = err.as_database_error().unwrap_or_else(|| panic!("{}: {err}", c.name));
        assert_eq!(db_err.code().as_deref(), Some(c.code), "{}: {}", c.name, db_err.message());
        assert!(db_err.message().contains(c.message), "{}: got {:?}, want {:?}", c.name, db_err.message(), c.message);
        assert_eq!(db.group_count().await, 0, "{}: a row was stored", c.name);
    }
}

#[tokio::test]
async fn reward_beyond_double_range_is_refused_as_not_finite() {
    let db = setup().await;
    let err = sqlx::query("INSERT INTO trainq.groups (model, trajectories) VALUES ('m1', '[{\"reward\": 1e400, \"prompt_ids\": [1], \"completion_ids\": [2]}]')")
        .execute(&db.pool)
        .await
        .unwrap_err();
    let db_err = err.as_database_error().unwrap();
    assert_eq!(db_err.code().as_deref(), Some(sqlstate::REWARD_NOT_FINITE));
    assert!(db_err.message().contains("trajectory 0: field \"reward\" must be finite"));
    assert_eq!(db.group_count().await, 0);
}

#[tokio::test]
async fn one_bad_row_refuses_the_whole_multi_row_insert() {
    let db = setup().await;
    let err = sqlx::query("INSERT INTO trainq.groups (model, trajectories) VALUES ('m1', $1), ('m1', $2)")
        .bind(chat_group(&[0.0, 1.0]))
        .bind(json!([{"reward": 1}]))
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert_eq!(err.as_database_error().unwrap().code().as_deref(), Some(sqlstate::MISSING_CONTENT));
    assert_eq!(db.group_count().await, 0);
}

#[tokio::test]
async fn submit_group_reports_the_same_errors_through_the_rust_api() {
    let db = setup().await;
    let group = db::NewGroup {
        model: "m1".into(),
        trajectories: json!([{"reward": "NaN"}]),
        policy_version: None,
        metadata: json!({}),
    };
    let err = db::submit_group(&db.pool, &group).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("submit group to model \"m1\"") && text.contains("must be finite"), "{text}");
    let trainq_queue::Error::Database { source, .. } = &err else { panic!("{err}") };
    assert_eq!(sqlstate::code_of(source).as_deref(), Some(sqlstate::REWARD_NOT_FINITE));
}

#[tokio::test]
async fn good_groups_of_every_form_are_stored_with_their_reward_statistics() {
    let db = setup().await;
    let tool_chat = json!({
        "messages": [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}],
             "token_ids": [10, 11, 12], "logprobs": [-0.1, -0.2, -0.0]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."}
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        "reward": 3, "metrics": {"turns": 2}, "metadata": {"seed": 1}
    });
    let pretokenized =
        json!({"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "logprobs": [-0.5, -1.5], "reward": 1});
    let id = db::submit_group(
        &db.pool,
        &db::NewGroup {
            model: "m1".into(),
            trajectories: json!([tool_chat, pretokenized, chat_trajectory(2.0)]),
            policy_version: Some(StepNumber(2)),
            metadata: json!({"env": "weather"}),
        },
    )
    .await
    .unwrap();
    let row: (i32, f64, f64, i32, String) = sqlx::query_as(
        "SELECT reward_count, reward_mean, reward_std, reward_distinct, submitted_by::text FROM trainq.groups WHERE id = $1")
        .bind(id).fetch_one(&db.pool).await.unwrap();
    // rewards [3, 1, 2]: mean 2, population std sqrt(2/3)
    assert_eq!((row.0, row.1, row.3), (3, 2.0, 3));
    assert!((row.2 - (2.0f64 / 3.0).sqrt()).abs() < 1e-12);
    assert_eq!(row.4, "postgres");
    let rewards: Vec<f64> =
        sqlx::query_scalar("SELECT reward FROM trainq.trajectories WHERE group_id = $1 ORDER BY index")
            .bind(id)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(rewards, vec![3.0, 1.0, 2.0]);
    let status = db::group_status(&db.pool, id).await.unwrap().unwrap();
    assert_eq!((status.state.as_str(), status.model.as_str()), ("pending", "m1"));
}

#[tokio::test]
async fn copy_and_multi_row_insert_go_through_the_same_validation() {
    let db = setup().await;
    sqlx::query("INSERT INTO trainq.groups (model, trajectories) VALUES ('m1', $1), ('m1', $2)")
        .bind(chat_group(&[0.0, 1.0]))
        .bind(chat_group(&[1.0, 1.0]))
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut copy =
        conn.copy_in_raw("COPY trainq.groups (model, trajectories, policy_version) FROM STDIN").await.unwrap();
    let line = format!("m1\t{}\t1\n", chat_group(&[0.25, 0.75]));
    copy.send(line.as_bytes()).await.unwrap();
    assert_eq!(copy.finish().await.unwrap(), 1);
    let mut bad = conn.copy_in_raw("COPY trainq.groups (model, trajectories) FROM STDIN").await.unwrap();
    bad.send(format!("m1\t{}\n", json!([{"reward": "x"}])).as_bytes()).await.unwrap();
    let err = bad.finish().await.unwrap_err();
    assert_eq!(err.as_database_error().unwrap().code().as_deref(), Some(sqlstate::REWARD_NOT_NUMBER));
    drop(conn);
    let stds: Vec<f64> =
        sqlx::query_scalar("SELECT reward_std FROM trainq.groups ORDER BY id").fetch_all(&db.pool).await.unwrap();
    assert_eq!(stds, vec![0.5, 0.0, 0.25]);
}

#[tokio::test]
async fn a_valid_group_that_the_fast_path_flags_is_still_stored() {
    // `tool_calls: null` on a user message and top-level `logprobs` beside messages make the
    // jsonpath fast path look closer; the exact walk accepts them.
    let db = setup().await;
    let group = json!([{
        "messages": [{"role": "user", "content": "x", "tool_calls": null}, {"role": "assistant", "content": "y"}],
        "logprobs": [-1.0],
        "reward": 1
    }]);
    let flagged: bool =
        sqlx::query_scalar("SELECT trainq.group_may_be_invalid($1)").bind(&group).fetch_one(&db.pool).await.unwrap();
    assert!(flagged);
    sqlx::query("INSERT INTO trainq.groups (model, trajectories) VALUES ('m1', $1)")
        .bind(&group)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(db.group_count().await, 1);
    let typical = chat_group(&[0.0, 1.0]);
    let flagged: bool =
        sqlx::query_scalar("SELECT trainq.group_may_be_invalid($1)").bind(&typical).fetch_one(&db.pool).await.unwrap();
    assert!(!flagged, "a typical valid group takes the fast path");
}
