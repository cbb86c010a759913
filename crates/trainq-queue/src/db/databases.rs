//! Whole databases: creating a fresh one for the demo (and anything else that wants its own), and
//! writing a database URL into a message without its password.

use sqlx::PgPool;

use crate::error::{Error, Result};

/// Drops database `name` if it exists (closing its sessions) and creates it empty; returns the
/// URL of the new database on the same server as `server_url`.
pub async fn recreate_database(server_url: &str, name: &str) -> Result<String> {
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(Error::config("database", format!("{name:?}: use letters, digits and _")));
    }
    let what = || format!("connect to {}", redact_database_url(server_url));
    let admin = PgPool::connect(server_url).await.map_err(Error::db(what()))?;
    for statement in [format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"), format!("CREATE DATABASE {name}")] {
        sqlx::query(&statement).execute(&admin).await.map_err(Error::db(statement.clone()))?;
    }
    admin.close().await;
    let mut url = url::Url::parse(server_url)
        .map_err(|e| Error::config("database url", format!("{}: {e}", redact_database_url(server_url))))?;
    url.set_path(name);
    Ok(url.to_string())
}

/// `url` with every password replaced by `***`, for messages: the user-info password of a URL
/// (`postgres://user:secret@host/db`) and any `password=` / `sslpassword=` parameter (in a query
/// string or a keyword/value connection string) — also when `url` does not parse, which is when
/// it is most likely to be printed.
pub fn redact_database_url(url: &str) -> String {
    let hidden = match url.find("://") {
        Some(scheme_end) => {
            let rest = &url[scheme_end + 3..];
            // The user info ends at the last '@' before the path (a password may hold '@' or '/').
            let authority_end = rest.find(['?', '#']).unwrap_or(rest.len());
            match rest[..authority_end].rfind('@') {
                Some(at) => {
                    let userinfo = &rest[..at];
                    let user = userinfo.split_once(':').map_or(userinfo, |(user, _password)| user);
                    let password = if userinfo.contains(':') { ":***" } else { "" };
                    format!("{}{user}{password}{}", &url[..scheme_end + 3], &rest[at..])
                }
                None => url.to_string(),
            }
        }
        None => url.to_string(),
    };
    redact_password_parameters(&hidden)
}

/// Replaces the value of every `…password=VALUE` parameter (up to `&`, whitespace or the end).
fn redact_password_parameters(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.to_ascii_lowercase().find("password=") {
        let value_start = at + "password=".len();
        out.push_str(&rest[..value_start]);
        out.push_str("***");
        let tail = &rest[value_start..];
        let value_end = tail.find(|c: char| c == '&' || c.is_whitespace()).unwrap_or(tail.len());
        rest = &tail[value_end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::redact_database_url;

    #[test]
    fn passwords_are_hidden_in_good_and_malformed_urls() {
        let cases = [
            ("postgres://alice:s3cret@db:5432/trainq", "postgres://alice:***@db:5432/trainq"),
            ("postgres://alice:s3cret@db:notaport/trainq", "postgres://alice:***@db:notaport/trainq"),
            ("postgres://alice:p@ss/w:rd@db/trainq", "postgres://alice:***@db/trainq"),
            ("postgres://alice@db/trainq", "postgres://alice@db/trainq"),
            (
                "postgres://db/trainq?user=a&password=s3cret&sslmode=require",
                "postgres://db/trainq?user=a&password=***&sslmode=require",
            ),
            ("host=db user=a password=s3cret dbname=trainq", "host=db user=a password=*** dbname=trainq"),
            ("postgres://db/x?sslpassword=s3cret", "postgres://db/x?sslpassword=***"),
            ("not a url at all", "not a url at all"),
        ];
        for (url, want) in cases {
            let got = redact_database_url(url);
            assert_eq!(got, want, "{url}");
            assert!(!got.contains("s3cret") && !got.contains("p@ss"), "{got}");
        }
    }
}
