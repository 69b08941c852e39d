//! The shim's own configuration file (`/etc/shadow/config.toml` by default).
//!
//! Kept deliberately small: where runc is and where it keeps state, and the
//! log level. The pairing issue will add its knobs here. A missing default
//! file means defaults; a file that exists but does not parse is an error
//! that names the file, because silently ignoring it would run containers
//! with settings the operator did not ask for.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const DEFAULT_CONFIG_PATH: &str = "/etc/shadow/config.toml";

/// Environment variables through which `start` hands the resolved config
/// source to the serving daemon (its stdin is not the runtime options).
pub const ENV_CONFIG_PATH: &str = "SHADOW_SHIM_CONFIG_PATH";
pub const ENV_CONFIG_BODY: &str = "SHADOW_SHIM_CONFIG_BODY";
/// Replaces the default config file path when no runtime option names one.
pub const ENV_CONFIG_DEFAULT: &str = "SHADOW_CONFIG";

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

    pub fn load(&self) -> Result<Config> {
        if let Some(body) = &self.body {
            return Config::parse(body, Path::new("<runtime options config_body>"));
        }
        match &self.path {
            Some(path) => Config::read(path, true),
            // containerd passes its environment to the shims it starts, so an
            // operator (or a test's private containerd) can move the default.
            None => match std::env::var_os(ENV_CONFIG_DEFAULT).filter(|p| !p.is_empty()) {
                Some(path) => Config::read(Path::new(&path), true),
                None => Config::read(Path::new(DEFAULT_CONFIG_PATH), false),
            },
        }
    }
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
        match std::fs::read_to_string(path) {
            Ok(text) => Config::parse(&text, path),
            // NotADirectory: on most hosts /etc/shadow is the password file.
            Err(e)
                if !must_exist
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                    ) =>
            {
                Ok(Config::default())
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
    fn missing_explicit_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("absent.toml");
        let src = ConfigSource {
            body: None,
            path: Some(p.clone()),
        };
        let e = src.load().unwrap_err().to_string();
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
        let c = src.load().unwrap();
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
