//! The shim's own configuration file: `/etc/containerd/shadow.toml` by
//! default, read without any flag or runtime option. The earlier default
//! `/etc/shadow/config.toml` is read only when the new one is absent, as a
//! deprecated fallback (on most hosts `/etc/shadow` is the password file,
//! so it could never exist there).
//!
//! Kept deliberately small: where runc is and where it keeps state, and the
//! log level. The pairing issue will add its knobs here. A missing default
//! file means defaults; a file that exists but does not parse is an error
//! that names the file, because silently ignoring it would run containers
//! with settings the operator did not ask for.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const DEFAULT_CONFIG_PATH: &str = "/etc/containerd/shadow.toml";
/// The default before 2026-11-30, read only when [`DEFAULT_CONFIG_PATH`]
/// is absent, with a deprecation warning.
pub const DEPRECATED_CONFIG_PATH: &str = "/etc/shadow/config.toml";

/// Environment variables through which `start` hands the resolved config
/// source to the serving daemon (its stdin is not the runtime options).
pub const ENV_CONFIG_PATH: &str = "SHADOW_SHIM_CONFIG_PATH";
pub const ENV_CONFIG_BODY: &str = "SHADOW_SHIM_CONFIG_BODY";
/// Replaces the default config file path when no runtime option names one.
pub const ENV_CONFIG_DEFAULT: &str = "SHADOW_CONFIG";
/// Where `start` found its config ([`Origin`]), for the daemon's log.
pub const ENV_CONFIG_ORIGIN: &str = "SHADOW_SHIM_CONFIG_ORIGIN";

/// Where a loaded config came from: the shim logs it, so an operator can
/// tell which file is in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// `config_body` of the runtime options.
    Body,
    /// A file: named by the runtime options or `SHADOW_CONFIG`, or the default.
    File(PathBuf),
    /// The deprecated default, [`DEPRECATED_CONFIG_PATH`].
    Deprecated(PathBuf),
    /// No file at either default: built-in defaults.
    Defaults,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Body => f.write_str("the runtime options' config_body"),
            Origin::File(p) => write!(f, "{}", p.display()),
            Origin::Deprecated(p) => write!(f, "{} (deprecated)", p.display()),
            Origin::Defaults => write!(
                f,
                "built-in defaults (no {DEFAULT_CONFIG_PATH}, no {DEPRECATED_CONFIG_PATH})"
            ),
        }
    }
}

impl Origin {
    /// Log which config is in force; a deprecated file is a warning.
    pub fn log(&self) {
        match self {
            Origin::Deprecated(p) => log::warn!(
                "config: read {} which is deprecated: move it to {DEFAULT_CONFIG_PATH}, read there without flags",
                p.display()
            ),
            other => log::info!("config: read {other}"),
        }
    }

    /// The form `start` hands to the daemon in [`ENV_CONFIG_ORIGIN`].
    pub fn to_env(&self) -> String {
        match self {
            Origin::Body => "body".into(),
            Origin::File(p) => format!("file:{}", p.display()),
            Origin::Deprecated(p) => format!("deprecated:{}", p.display()),
            Origin::Defaults => "defaults".into(),
        }
    }

    pub fn from_env(value: &str) -> Option<Origin> {
        match value.split_once(':') {
            Some(("file", p)) => Some(Origin::File(p.into())),
            Some(("deprecated", p)) => Some(Origin::Deprecated(p.into())),
            _ if value == "body" => Some(Origin::Body),
            _ if value == "defaults" => Some(Origin::Defaults),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub runc: RuncConfig,
    /// `error`, `warn`, `info`, `debug` or `trace`.
    pub log_level: String,
    /// Engine pairs (`shadow.dev/pair`): see `crate::pair::config`.
    pub pair: crate::pair::config::PairConfig,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuncConfig {
    /// runc binary: a name looked up on PATH, or an absolute path.
    pub binary: String,
    /// Parent of runc's per-namespace state roots, as runc-v2 uses.
    pub root: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            runc: RuncConfig::default(),
            log_level: "info".into(),
            pair: Default::default(),
        }
    }
}

impl Default for RuncConfig {
    fn default() -> Self {
        RuncConfig {
            binary: "runc".into(),
            root: PathBuf::from("/run/containerd/runc"),
        }
    }
}

/// Where the configuration comes from, in order of precedence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigSource {
    /// TOML given inline by the containerd runtime entry (`config_body`).
    pub body: Option<String>,
    /// An explicit file (`config_path`); it must exist.
    pub path: Option<PathBuf>,
}

impl ConfigSource {
    /// The source the serving daemon was handed by `start`.
    pub fn from_env() -> Self {
        ConfigSource {
            body: std::env::var(ENV_CONFIG_BODY)
                .ok()
                .filter(|s| !s.is_empty()),
            path: std::env::var(ENV_CONFIG_PATH)
                .ok()
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
        }
    }

    /// Environment to pass so that a child reloads the same source.
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        let mut env = Vec::new();
        if let Some(b) = &self.body {
            env.push((ENV_CONFIG_BODY, b.clone()));
        }
        if let Some(p) = &self.path {
            env.push((ENV_CONFIG_PATH, p.display().to_string()));
        }
        env
    }

    /// The config, and where it came from.
    pub fn load_with_origin(&self) -> Result<(Config, Origin)> {
        if let Some(body) = &self.body {
            let c = Config::parse(body, Path::new("<runtime options config_body>"))?;
            return Ok((c, Origin::Body));
        }
        if let Some(path) = &self.path {
            return Ok((Config::read(path, true)?, Origin::File(path.clone())));
        }
        // containerd passes its environment to the shims it starts, so an
        // operator (or a test's private containerd) can move the default.
        if let Some(path) = std::env::var_os(ENV_CONFIG_DEFAULT).filter(|p| !p.is_empty()) {
            let path = PathBuf::from(path);
            return Ok((Config::read(&path, true)?, Origin::File(path)));
        }
        load_defaults(
            Path::new(DEFAULT_CONFIG_PATH),
            Path::new(DEPRECATED_CONFIG_PATH),
        )
    }
}

/// The default file, else the deprecated one, else built-in defaults. A
/// file is absent when it, or a directory above it, does not exist (ENOENT,
/// ENOTDIR: `/etc/shadow` is usually the password file).
fn load_defaults(default: &Path, deprecated: &Path) -> Result<(Config, Origin)> {
    if let Some(c) = Config::read_if_present(default)? {
        return Ok((c, Origin::File(default.to_path_buf())));
    }
    if let Some(c) = Config::read_if_present(deprecated)? {
        return Ok((c, Origin::Deprecated(deprecated.to_path_buf())));
    }
    Ok((Config::default(), Origin::Defaults))
}

impl Config {
    pub fn parse(text: &str, origin: &Path) -> Result<Config> {
        let config: Config = toml::from_str(text).map_err(|e| Error::Config {
            path: origin.to_path_buf(),
            reason: e.to_string(),
        })?;
        config.validate(origin)?;
        Ok(config)
    }

    fn read(path: &Path, must_exist: bool) -> Result<Config> {
        match Config::read_if_present(path)? {
            Some(c) => Ok(c),
            None if !must_exist => Ok(Config::default()),
            None => Err(Error::Config {
                path: path.to_path_buf(),
                reason: "no such file".into(),
            }),
        }
    }

    /// The file's config, or `None` when it is absent (ENOENT, ENOTDIR).
    fn read_if_present(path: &Path) -> Result<Option<Config>> {
        match std::fs::read_to_string(path) {
            Ok(text) => Config::parse(&text, path).map(Some),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(Error::Config {
                path: path.to_path_buf(),
                reason: e.to_string(),
            }),
        }
    }

    fn validate(&self, origin: &Path) -> Result<()> {
        const LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];
        if !LEVELS.contains(&self.log_level.as_str()) {
            return Err(Error::Config {
                path: origin.to_path_buf(),
                reason: format!(
                    "log_level = {:?}: allowed {}",
                    self.log_level,
                    LEVELS.join("|")
                ),
            });
        }
        if self.runc.binary.is_empty() || !self.runc.root.is_absolute() {
            return Err(Error::Config {
                path: origin.to_path_buf(),
                reason: "runc.binary must be set and runc.root must be absolute".into(),
            });
        }
        self.pair.validate().map_err(|reason| Error::Config {
            path: origin.to_path_buf(),
            reason,
        })?;
        Ok(())
    }

    /// runc's state directory for one containerd namespace.
    pub fn runc_root(&self, namespace: &str) -> PathBuf {
        self.runc.root.join(namespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_default_file_means_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let c = Config::read(&dir.path().join("absent.toml"), false).unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn the_default_is_etc_containerd_and_the_old_path_a_fallback() {
        assert_eq!(DEFAULT_CONFIG_PATH, "/etc/containerd/shadow.toml");
        assert_eq!(DEPRECATED_CONFIG_PATH, "/etc/shadow/config.toml");
        let dir = tempfile::tempdir().unwrap();
        let new = dir.path().join("containerd/shadow.toml");
        let old = dir.path().join("shadow/config.toml");
        // Neither: defaults. ENOTDIR (a file where the directory would be,
        // as /etc/shadow is) is absent too.
        std::fs::write(dir.path().join("shadow"), "root:*:0:0:::::\n").unwrap();
        let (c, origin) = load_defaults(&new, &old).unwrap();
        assert_eq!((c, origin), (Config::default(), Origin::Defaults));
        // Only the old one: read, marked deprecated.
        std::fs::remove_file(dir.path().join("shadow")).unwrap();
        std::fs::create_dir_all(old.parent().unwrap()).unwrap();
        std::fs::write(&old, "log_level = \"debug\"\n").unwrap();
        let (c, origin) = load_defaults(&new, &old).unwrap();
        assert_eq!(c.log_level, "debug");
        assert_eq!(origin, Origin::Deprecated(old.clone()));
        assert!(origin.to_string().contains("deprecated"), "{origin}");
        // Both: the new one wins.
        std::fs::create_dir_all(new.parent().unwrap()).unwrap();
        std::fs::write(&new, "log_level = \"warn\"\n").unwrap();
        let (c, origin) = load_defaults(&new, &old).unwrap();
        assert_eq!(c.log_level, "warn");
        assert_eq!(origin, Origin::File(new.clone()));
        // A default file that does not parse is an error naming it, not a
        // silent fall back to the old one.
        std::fs::write(&new, "log_level = [").unwrap();
        let e = load_defaults(&new, &old).unwrap_err().to_string();
        assert!(e.contains(&new.display().to_string()), "{e}");
    }

    #[test]
    fn origins_travel_through_the_environment() {
        for o in [
            Origin::Body,
            Origin::Defaults,
            Origin::File("/etc/containerd/shadow.toml".into()),
            Origin::Deprecated("/etc/shadow/config.toml".into()),
        ] {
            assert_eq!(Origin::from_env(&o.to_env()), Some(o));
        }
        assert_eq!(Origin::from_env("nonsense"), None);
    }

    #[test]
    fn missing_explicit_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("absent.toml");
        let src = ConfigSource {
            body: None,
            path: Some(p.clone()),
        };
        let e = src.load_with_origin().unwrap_err().to_string();
        assert!(e.contains(&p.display().to_string()), "{e}");
    }

    #[test]
    fn unparsable_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, "runc = [[[").unwrap();
        let e = Config::read(&p, false).unwrap_err().to_string();
        assert!(e.contains("bad.toml"), "{e}");
    }

    #[test]
    fn unknown_key_and_bad_level_are_rejected() {
        assert!(Config::parse("colour = 1", Path::new("x")).is_err());
        let e = Config::parse("log_level = \"loud\"", Path::new("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("loud") && e.contains("debug"), "{e}");
    }

    #[test]
    fn body_overrides_path_and_fills_defaults() {
        let src = ConfigSource {
            body: Some("[runc]\nbinary = \"/usr/sbin/runc\"\n".into()),
            path: Some("/nonexistent".into()),
        };
        let (c, origin) = src.load_with_origin().unwrap();
        assert_eq!(origin, Origin::Body);
        assert_eq!(c.runc.binary, "/usr/sbin/runc");
        assert_eq!(c.runc.root, PathBuf::from("/run/containerd/runc"));
        assert_eq!(
            c.runc_root("k8s.io"),
            PathBuf::from("/run/containerd/runc/k8s.io")
        );
        assert_eq!(ConfigSource::from_env_pairs(&src.to_env()), src);
    }

    impl ConfigSource {
        fn from_env_pairs(pairs: &[(&str, String)]) -> Self {
            let get = |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
            ConfigSource {
                body: get(ENV_CONFIG_BODY),
                path: get(ENV_CONFIG_PATH).map(PathBuf::from),
            }
        }
    }
}
