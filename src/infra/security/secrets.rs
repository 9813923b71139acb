//! Secrets: secret files, and which librdkafka settings hold secrets.
//!
//! Invariant: a secret file is read whole, once, and an empty one is
//! refused rather than taken for an empty password; a setting whose name
//! says it holds a secret is never shown.

use std::path::{Path, PathBuf};

/// Whether a librdkafka property holds a secret (`sasl.password`,
/// `ssl.key.password`, `sasl.oauthbearer.client.secret`, ...).
pub fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.contains("password") || key.contains("secret")
}

/// A secret file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds nothing but line ends.
    #[error("{} is empty", .0.display())]
    Empty(PathBuf),
}

/// Reads a secret from a file: the whole content, without the trailing newline
/// most editors and `kubectl create secret --from-file` leave.
pub fn read_secret_file(path: &Path) -> Result<String, SecretError> {
    let text = std::fs::read_to_string(path).map_err(|source| SecretError::Unreadable {
        path: path.to_path_buf(),
        source,
    })?;
    let secret = text.trim_end_matches(['\r', '\n']);
    if secret.is_empty() {
        return Err(SecretError::Empty(path.to_path_buf()));
    }
    Ok(secret.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_keys_are_told_by_name() {
        assert!(is_secret_key("sasl.password"));
        assert!(is_secret_key("ssl.key.password"));
        assert!(is_secret_key("sasl.oauthbearer.client.secret"));
        assert!(!is_secret_key("sasl.username"));
    }

    #[test]
    fn secret_files_lose_their_trailing_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        std::fs::write(&path, "hunter2\n").unwrap();
        assert_eq!(read_secret_file(&path).unwrap(), "hunter2");
        std::fs::write(&path, "\n").unwrap();
        assert!(read_secret_file(&path).is_err());
        assert!(read_secret_file(&dir.path().join("missing")).is_err());
    }
}
