//! API keys: a bearer token in the `authorization` metadata (`Bearer <key>`), checked against
//! the file `serving.api_keys` names, which holds only SHA-256 hashes of the keys, one per
//! line as `<name> sha256:<64 hex digits>` (`#` starts a comment). `ditstream keys add` makes
//! a key and appends its line; SIGHUP reloads the file (a file that no longer parses keeps the
//! keys already loaded, and the error is logged).
//!
//! A request belongs to the name of the key that made it: several keys may share a name (a
//! rotation), and they then see each other's requests. Without a keys file there is one
//! principal, `anonymous`, and no authentication (allowed on loopback only).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use anyhow::Context;
use ditstream_common::status;
use tonic::Status;

/// The principal of every request when no keys file is configured.
pub const ANONYMOUS: &str = "anonymous";

/// What the server knows of its keys.
pub struct Keys {
    /// `None`: no authentication.
    path: Option<PathBuf>,
    /// Key hash → key name.
    table: RwLock<HashMap<[u8; 32], String>>,
}

fn sha256(key: &str) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses a keys file's text; errors name the line.
fn parse(text: &str, origin: &Path) -> anyhow::Result<HashMap<[u8; 32], String>> {
    let mut table = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| anyhow::anyhow!("{}:{}: {why}", origin.display(), i + 1);
        let mut fields = line.split_whitespace();
        let (Some(name), Some(hash), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(bad("expected `<name> sha256:<64 hex digits>`"));
        };
        let digits = hash
            .strip_prefix("sha256:")
            .filter(|d| d.len() == 64)
            .ok_or_else(|| bad("the hash must be `sha256:` and 64 hex digits"))?;
        let mut h = [0u8; 32];
        for (j, byte) in h.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&digits[2 * j..2 * j + 2], 16)
                .map_err(|_| bad("the hash must be `sha256:` and 64 hex digits"))?;
        }
        table.insert(h, name.to_string());
    }
    Ok(table)
}

impl Keys {
    /// Loads `path` (`None`: no authentication).
    pub fn load(path: Option<PathBuf>) -> anyhow::Result<Keys> {
        let keys = Keys {
            path,
            table: RwLock::default(),
        };
        keys.reload()?;
        Ok(keys)
    }

    /// Whether clients must present a key.
    pub fn required(&self) -> bool {
        self.path.is_some()
    }

    /// Reads the file again; returns how many keys it holds. On an error the keys already
    /// loaded stay.
    pub fn reload(&self) -> anyhow::Result<usize> {
        let Some(path) = &self.path else {
            return Ok(0);
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("serving.api_keys: cannot read {}", path.display()))?;
        let table = parse(&text, path)?;
        let n = table.len();
        *self
            .table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = table;
        Ok(n)
    }

    /// The principal a call acts for: the name of its key, or [`ANONYMOUS`] without a keys
    /// file. UNAUTHENTICATED when the key is missing or unknown.
    pub fn authenticate(&self, metadata: &tonic::metadata::MetadataMap) -> Result<String, Status> {
        if !self.required() {
            return Ok(ANONYMOUS.to_string());
        }
        let Some(value) = metadata.get("authorization") else {
            return Err(status::unauthenticated(
                "this server needs an API key: send `authorization: Bearer <key>`",
            ));
        };
        let key = value
            .to_str()
            .ok()
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .ok_or_else(|| {
                status::unauthenticated("the authorization metadata must be `Bearer <key>`")
            })?;
        // The lookup is by the key's hash: timing can at most reveal a hash prefix, which does
        // not help to find a key.
        self.table
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&sha256(key.trim()))
            .cloned()
            .ok_or_else(|| status::unauthenticated("unknown API key"))
    }
}

/// A new key for `name`: the key itself (shown once) and the line for the keys file.
pub fn new_key(name: &str) -> anyhow::Result<(String, String)> {
    if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c == '#') {
        anyhow::bail!("--name {name:?}: must be non-empty, without spaces or `#`");
    }
    let key = format!("ds-{}", hex(&rand::random::<[u8; 32]>()));
    let line = format!("{name} sha256:{}", hex(&sha256(&key)));
    Ok((key, line))
}

/// `ditstream keys add`: appends a new key for `name` to `file` (made readable by its owner
/// only) and returns the key.
pub fn add(file: &Path, name: &str) -> anyhow::Result<String> {
    use std::io::Write;
    let (key, line) = new_key(name)?;
    let mut options = std::fs::OpenOptions::new();
    options.create(true).append(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut f = options
        .open(file)
        .with_context(|| format!("opening {}", file.display()))?;
    writeln!(f, "{line}").with_context(|| format!("writing {}", file.display()))?;
    Ok(key)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn metadata(auth: Option<&str>) -> tonic::metadata::MetadataMap {
        let mut m = tonic::metadata::MetadataMap::new();
        if let Some(a) = auth {
            m.insert("authorization", a.parse().unwrap());
        }
        m
    }

    #[test]
    fn keys_authenticate_by_hash_and_reload() {
        let dir = std::env::temp_dir().join(format!("ditstream-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys.txt");
        let _ = std::fs::remove_file(&file);
        let alice = add(&file, "alice").unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(!text.contains(&alice), "the file holds the key itself");
        let keys = Keys::load(Some(file.clone())).unwrap();
        let who = keys.authenticate(&metadata(Some(&format!("Bearer {alice}"))));
        assert_eq!(who.unwrap(), "alice");
        for bad in [None, Some("Bearer ds-nope"), Some(alice.as_str())] {
            let e = keys.authenticate(&metadata(bad)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{bad:?}");
        }
        // A key added later works after a reload; a broken file keeps the old keys.
        let bob = add(&file, "bob").unwrap();
        assert!(
            keys.authenticate(&metadata(Some(&format!("Bearer {bob}"))))
                .is_err()
        );
        assert_eq!(keys.reload().unwrap(), 2);
        assert_eq!(
            keys.authenticate(&metadata(Some(&format!("Bearer {bob}"))))
                .unwrap(),
            "bob"
        );
        std::fs::write(&file, "carol sha256:xyz\n").unwrap();
        let e = keys.reload().unwrap_err().to_string();
        assert!(
            e.ends_with("keys.txt:1: the hash must be `sha256:` and 64 hex digits"),
            "{e}"
        );
        assert_eq!(
            keys.authenticate(&metadata(Some(&format!("Bearer {bob}"))))
                .unwrap(),
            "bob"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn without_a_file_everyone_is_anonymous() {
        let keys = Keys::load(None).unwrap();
        assert!(!keys.required());
        assert_eq!(keys.authenticate(&metadata(None)).unwrap(), ANONYMOUS);
    }
}
