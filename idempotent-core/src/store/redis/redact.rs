//! URLs as logs and errors show them: without their passwords.

/// Hides the password of a `redis://user:password@host` URL.
pub(super) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &url[scheme + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!(
                "{}://{}{}",
                &url[..scheme],
                if user.is_empty() { String::new() } else { format!("{user}:***") },
                &url[at..]
            )
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(redact("redis://user:secret@host:6379/0"), "redis://user:***@host:6379/0");
        assert_eq!(redact("rediss://:secret@host"), "rediss://@host");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }
}
