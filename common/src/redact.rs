//! Connection strings carry passwords; nothing that reaches a log or an error may show one.

/// Returns the URL with its password replaced by `****`, e.g.
/// `postgres://app:****@db:5432/app`. Text that is not a URL is returned unchanged.
pub fn redact_url(text: &str) -> String {
    match url::Url::parse(text) {
        Ok(mut url) if url.password().is_some() => {
            let _ = url.set_password(Some("****"));
            url.to_string()
        }
        Ok(url) => {
            // `password=` can also ride in the query string of a PostgreSQL URL.
            if url.query_pairs().any(|(key, _)| key == "password") {
                let mut redacted = url.clone();
                let pairs: Vec<(String, String)> = url
                    .query_pairs()
                    .map(|(k, v)| {
                        let value = if k == "password" {
                            "****".to_string()
                        } else {
                            v.into_owned()
                        };
                        (k.into_owned(), value)
                    })
                    .collect();
                redacted.query_pairs_mut().clear().extend_pairs(pairs);
                redacted.to_string()
            } else {
                text.to_string()
            }
        }
        Err(_) => text.to_string(),
    }
}

/// Replaces every occurrence of each secret inside `message` (e.g. a driver error that quotes
/// the URL it failed to reach).
pub fn redact_secrets(message: &str, urls: &[&str]) -> String {
    let mut out = message.to_string();
    for url in urls {
        if let Ok(parsed) = url::Url::parse(url)
            && let Some(password) = parsed.password()
            && !password.is_empty()
        {
            out = out.replace(password, "****");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_passwords_in_userinfo_and_query() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/app"),
            "postgres://app:****@db:5432/app"
        );
        assert!(!redact_url("postgres://db/app?user=a&password=s3cret").contains("s3cret"));
        assert_eq!(redact_url("postgres://db/app"), "postgres://db/app");
        assert_eq!(
            redact_secrets("cannot reach postgres://app:s3cret@db", &["postgres://app:s3cret@db"]),
            "cannot reach postgres://app:****@db"
        );
    }
}
