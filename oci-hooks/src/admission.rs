//! Who may join a pair. Without the shim nobody creates pairs for
//! containers, so the operator does: `shadow-oci-hook gms start --pair P`
//! (or `gms run`) records in `<root>/P/admission.json` which containers may
//! join, and the hooks refuse every other container that names `P` — it
//! would otherwise get `P`'s lock and GMS socket just by writing
//! `shadow.dev/pair-name=P` in its own annotations.
//!
//! What a hook can check is what the runtime hands it: the container's
//! annotations and its process uid (config.json). Both are written by
//! whoever creates the container, so a rule is only as strong as the key
//! it names: under CRI-O, `io.kubernetes.pod.namespace` and
//! `io.kubernetes.pod.name` are set by the runtime from the pod sandbox (a
//! pod cannot choose them), which makes them the rule to use on a shared
//! Kubernetes node; under podman, whoever runs containers is root anyway,
//! and a rule keeps pairs apart rather than attackers out.
//!
//! The file lives in the pair's own directory, which is root's (0700) and
//! never bind-mounted into a container (only its `pair/` and `gms/`
//! subdirectories are).

use crate::error::{Error, Result};
use crate::layout::PairLayout;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// Every rule given must hold; at least one must be given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Admission {
    /// The container's `process.user.uid` must be one of these (if any).
    #[serde(default)]
    pub uids: Vec<u32>,
    /// The container must carry each of these annotations with this value.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// What the hook knows of a container.
pub struct Candidate<'a> {
    /// The container id, when the stage knows it (not at precreate).
    pub id: Option<&'a str>,
    pub uid: Option<u32>,
    pub annotations: &'a HashMap<String, String>,
}

impl Admission {
    /// From `--allow-uid` and `--allow-annotation KEY=VALUE` flags.
    pub fn from_flags(uids: &[u32], annotations: &[String]) -> Result<Self> {
        let mut a = Admission {
            uids: uids.to_vec(),
            annotations: BTreeMap::new(),
        };
        for kv in annotations {
            let (k, v) = kv
                .split_once('=')
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| Error::Shape {
                    what: "--allow-annotation",
                    why: format!("{kv:?} is not KEY=VALUE"),
                })?;
            a.annotations.insert(k.to_owned(), v.to_owned());
        }
        if a.uids.is_empty() && a.annotations.is_empty() {
            return Err(Error::Shape {
                what: "gms start/run",
                why: "say which containers may join the pair: --allow-annotation KEY=VALUE \
                      (e.g. io.kubernetes.pod.namespace=team-a under CRI-O) and/or --allow-uid UID"
                    .into(),
            });
        }
        Ok(a)
    }

    /// Writes `<pair>/admission.json` (0600, replaced whole).
    pub fn save(&self, layout: &PairLayout) -> Result<()> {
        let text = serde_json::to_vec_pretty(self).map_err(|source| Error::Json {
            what: "admission rules",
            source,
        })?;
        crate::files::replace(
            &layout.admission_file(),
            &text,
            0o600,
            "writing admission rules",
        )
    }

    /// The pair's rules; a pair the operator did not start has none, and
    /// nobody may join it.
    pub fn load(layout: &PairLayout) -> Result<Self> {
        let path = layout.admission_file();
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotAdmitted {
                    pair: layout.name.clone(),
                    why: format!(
                        "the pair was not created by the operator (no {}); run \
                         `shadow-oci-hook gms start --pair {} --allow-…` first",
                        path.display(),
                        layout.name
                    ),
                })
            }
            Err(e) => return Err(Error::io("reading", &path, e)),
        };
        serde_json::from_slice(&text).map_err(|source| Error::Json {
            what: "admission.json",
            source,
        })
    }

    /// Whether `c` may join; the error says which rule it broke.
    pub fn check(&self, pair: &str, c: &Candidate<'_>) -> Result<()> {
        let refuse = |why: String| {
            Err(Error::NotAdmitted {
                pair: pair.to_owned(),
                why: match c.id {
                    Some(id) => format!("container {id}: {why}"),
                    None => format!("this container: {why}"),
                },
            })
        };
        if !self.uids.is_empty() {
            match c.uid {
                Some(uid) if self.uids.contains(&uid) => {}
                Some(uid) => {
                    return refuse(format!(
                        "its uid {uid} is not one the pair admits ({:?})",
                        self.uids
                    ))
                }
                None => return refuse("its uid is unknown and the pair admits by uid".into()),
            }
        }
        for (k, v) in &self.annotations {
            if c.annotations.get(k) != Some(v) {
                return refuse(format!(
                    "it lacks the annotation {k}={v} the pair admits by"
                ));
            }
        }
        Ok(())
    }
}

/// Loads the pair's rules and checks a container against them.
pub fn admit(layout: &PairLayout, c: &Candidate<'_>) -> Result<()> {
    Admission::load(layout)?.check(&layout.name, c)
}

/// `process.user.uid` of a spec (config.json), if it says.
pub fn uid_of(spec: &serde_json::Value) -> Option<u32> {
    spec.pointer("/process/user/uid")
        .and_then(serde_json::Value::as_u64)
        .and_then(|u| u32::try_from(u).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate<'a>(uid: Option<u32>, ann: &'a HashMap<String, String>) -> Candidate<'a> {
        Candidate {
            id: Some("c1"),
            uid,
            annotations: ann,
        }
    }

    #[test]
    fn rules_must_be_given_and_all_must_hold() {
        assert!(Admission::from_flags(&[], &[]).is_err());
        assert!(Admission::from_flags(&[], &["=x".into()]).is_err());
        let a =
            Admission::from_flags(&[1000], &["io.kubernetes.pod.namespace=team-a".into()]).unwrap();
        let ours: HashMap<String, String> = [(
            "io.kubernetes.pod.namespace".to_owned(),
            "team-a".to_owned(),
        )]
        .into();
        let theirs: HashMap<String, String> = [(
            "io.kubernetes.pod.namespace".to_owned(),
            "team-b".to_owned(),
        )]
        .into();
        a.check("p", &candidate(Some(1000), &ours)).unwrap();
        for (uid, ann) in [(Some(0), &ours), (None, &ours), (Some(1000), &theirs)] {
            let e = a.check("p", &candidate(uid, ann)).unwrap_err();
            assert!(e.to_string().contains("may not join pair p"), "{e}");
        }
    }

    #[test]
    fn a_pair_nobody_started_admits_nobody_and_rules_round_trip() {
        let t = tempfile::tempdir().unwrap();
        let l = PairLayout::new(t.path(), "p").unwrap();
        let e = Admission::load(&l).unwrap_err();
        assert!(e.to_string().contains("gms start --pair p"), "{e}");
        l.prepare().unwrap();
        let a = Admission::from_flags(&[0], &[]).unwrap();
        a.save(&l).unwrap();
        a.save(&l).unwrap();
        assert_eq!(Admission::load(&l).unwrap(), a);
    }
}
