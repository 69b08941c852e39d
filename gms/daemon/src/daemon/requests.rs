//! What each request does, one function per kind, and the lease checks in
//! front of them. `handle` is the one dispatcher: a request that needs no
//! lease (`status`, `reset`, `hello`) goes to its function; every other one
//! is first checked against the connection's lease (held, not ended, `rw`
//! where it writes), then goes to its function with the store that lease
//! sees: the working store for the writer, the committed one for a reader.
//!
//! It exists apart from the connection thread so that the rules of
//! docs/gms-protocol.md ("Requests") read as a list, each next to the
//! errors it answers, with no framing or socket code in between. All but
//! `allocate` run under the daemon's lock from start to finish.

use std::os::fd::OwnedFd;

use gms::layout::MetadataLimits;
use gms::protocol::{LeaseKind, Mode, Request, Response};
use gms::{Access, Error, Result};

use super::{Connection, Daemon, State, Store};
use crate::lease::LeaseId;

/// An answer and the descriptors it carries.
type Reply = (Response, Vec<OwnedFd>);

impl Daemon {
    /// Answers one request of connection `conn_id`.
    /// `fds`: what the request carried (as many as its kind has, which
    /// the decoder checked).
    pub(super) fn handle(&self, conn_id: u64, req: Request, fds: Vec<OwnedFd>) -> Result<Reply> {
        if let Request::Allocate { tag, size, va } = req {
            // Takes the lock itself, twice (see `allocate`).
            return self.allocate(conn_id, tag, size, va);
        }
        if let Request::KvPool {
            size,
            index_bytes,
            va,
        } = req
        {
            // Checks the proof and makes the pool outside the lock.
            let proof = fds.into_iter().next().ok_or_else(|| Error::WrongFdCount {
                op: "kv_pool".into(),
                got: 0,
                want: 1,
            })?;
            return self.kv_pool(conn_id, proof, size, index_bytes, va);
        }
        let mut guard = self.lock();
        let st = &mut *guard;
        let op = req.op();
        if connection(st, conn_id)?.kv_writer {
            return Err(Error::NotPermitted {
                op: op.into(),
                why: "this connection is the KV pool's write lease; it takes no other request"
                    .into(),
            });
        }
        match req {
            Request::Status => Ok(self.status(st)),
            Request::Reset => reset(st, conn_id, op),
            Request::Hello { mode, client } => self.hello(st, conn_id, mode, client, op),
            other => {
                let (lease, kind) = lease_of(st, conn_id, op)?;
                self.under_lease(st, lease, kind, other, op)
            }
        }
    }

    /// The requests made under a lease, once the lease is known to hold.
    fn under_lease(
        &self,
        st: &mut State,
        lease: LeaseId,
        kind: LeaseKind,
        req: Request,
        op: &str,
    ) -> Result<Reply> {
        match req {
            Request::Free { id } => {
                require_writer(kind, op)?;
                free(st, id, op)
            }
            Request::PutMeta { key, value } => {
                require_writer(kind, op)?;
                self.put_meta(st, key, value, op)
            }
            Request::GetMeta { key } => Ok(get_meta(store_for(st, kind, op)?, key)),
            Request::GetLayout => Ok(get_layout(store_for(st, kind, op)?)),
            Request::Export { ids } => export(store_for(st, kind, op)?, kind, ids),
            Request::Commit => {
                require_writer(kind, op)?;
                commit(st, lease)
            }
            Request::Allocate { .. }
            | Request::Hello { .. }
            | Request::Status
            | Request::Reset
            | Request::KvPool { .. } => Err(Error::Backend(format!(
                "'{op}' reached the lease dispatcher"
            ))),
        }
    }

    /// `status`: a snapshot, allowed on any connection, lease or not.
    fn status(&self, st: &State) -> Reply {
        (
            Response::Status {
                status: Box::new(self.report(st)),
            },
            vec![],
        )
    }

    /// `hello`: once per connection; grants the lease `mode` asks for if
    /// the lease machine allows it, and a writer starts a working store.
    fn hello(
        &self,
        st: &mut State,
        conn_id: u64,
        mode: Mode,
        client: String,
        op: &str,
    ) -> Result<Reply> {
        let conn = connection(st, conn_id)?;
        if conn.said_hello {
            return Err(Error::NotPermitted {
                op: op.into(),
                why: "hello was already sent on this connection".into(),
            });
        }
        conn.said_hello = true;
        let (lease, kind) = st.leases.acquire(mode)?;
        let conn = connection(st, conn_id)?;
        conn.lease = Some(lease);
        conn.client = client;
        tracing::info!(lease, kind = %kind, pid = conn.pid, client = %conn.client, "lease granted");
        if kind == LeaseKind::Rw {
            st.begin_working();
        }
        Ok((
            Response::Welcome {
                lease: kind,
                lease_id: lease,
                backend: self.backend.name().into(),
                device: self.backend.device(),
                granularity: self.backend.granularity(),
                committed: st.leases.committed(),
            },
            vec![],
        ))
    }

    /// `put_meta`: one metadata entry into the writer's layout, within the
    /// metadata limits (counted as encoded).
    fn put_meta(&self, st: &mut State, key: String, value: String, op: &str) -> Result<Reply> {
        let limits = MetadataLimits {
            max_entries: self.config.limits.max_metadata_entries,
            max_bytes: self.config.limits.max_metadata_bytes,
        };
        let store = st.working.as_mut().ok_or_else(|| no_store(op))?;
        store
            .layout
            .put_meta(key.clone(), value, &limits, &mut store.metadata_encoded)?;
        Ok((Response::MetaStored { key }, vec![]))
    }

    /// The connection's lease id, if it is the writer.
    pub(super) fn writer_lease(&self, st: &State, conn_id: u64, op: &str) -> Result<LeaseId> {
        let (lease, kind) = lease_of(st, conn_id, op)?;
        require_writer(kind, op)?;
        Ok(lease)
    }
}

/// `reset`: only the supervisor, and only on a connection without a lease.
fn reset(st: &mut State, conn_id: u64, op: &str) -> Result<Reply> {
    let conn = connection(st, conn_id)?;
    if !conn.supervisor {
        return Err(Error::NotPermitted {
            op: op.into(),
            why: format!(
                "only gmsd's supervisor may reset; pid {} is not it",
                conn.pid
            ),
        });
    }
    if conn.lease.is_some() {
        return Err(Error::NotPermitted {
            op: op.into(),
            why: "reset is sent without a lease".into(),
        });
    }
    let pid = conn.pid;
    let pool = super::kv::reset_pool(st)?;
    let generation = st.reset()?;
    tracing::info!(
        generation,
        pid,
        kv_pool = pool.unwrap_or(0),
        "reset by the supervisor: committed layout and KV pool dropped"
    );
    Ok((Response::ResetDone { generation }, vec![]))
}

/// `free`: the allocation leaves the writer's layout and its memory goes.
fn free(st: &mut State, id: u64, op: &str) -> Result<Reply> {
    let store = st.working.as_mut().ok_or_else(|| no_store(op))?;
    store.layout.remove(id)?;
    store.memory.remove(&id);
    Ok((Response::Freed { id }, vec![]))
}

fn get_meta(store: &Store, key: String) -> Reply {
    let value = store.layout.metadata.get(&key).cloned();
    (Response::Meta { key, value }, vec![])
}

fn get_layout(store: &Store) -> Reply {
    (
        Response::Layout {
            layout: store.layout.clone(),
        },
        vec![],
    )
}

/// `export`: one descriptor per id, in order; read-only for a reader.
fn export(store: &Store, kind: LeaseKind, ids: Vec<u64>) -> Result<Reply> {
    let access = match kind {
        LeaseKind::Rw => Access::ReadWrite,
        LeaseKind::Ro => Access::ReadOnly,
    };
    let mut fds = Vec::with_capacity(ids.len());
    for id in &ids {
        let memory = store.memory.get(id).ok_or(Error::UnknownAllocation(*id))?;
        fds.push(memory.export(access)?);
    }
    Ok((Response::Exported { ids }, fds))
}

/// `commit`: see `State::commit`.
fn commit(st: &mut State, lease: LeaseId) -> Result<Reply> {
    let done = st.commit(lease)?;
    Ok((
        Response::Committed {
            generation: done.generation,
            allocations: done.allocations,
            bytes: done.bytes,
        },
        vec![],
    ))
}

/// The connection `conn_id`, which its own thread cannot outlive.
fn connection(st: &mut State, conn_id: u64) -> Result<&mut Connection> {
    st.connections
        .get_mut(&conn_id)
        .ok_or_else(|| Error::Backend(format!("connection {conn_id} vanished")))
}

/// The lease connection `conn_id` holds, and its kind: refused if it never
/// said hello or its lease has ended.
fn lease_of(st: &State, conn_id: u64, op: &str) -> Result<(LeaseId, LeaseKind)> {
    let conn = st
        .connections
        .get(&conn_id)
        .ok_or_else(|| Error::Backend(format!("connection {conn_id} vanished")))?;
    let lease = conn.lease.ok_or_else(|| Error::NotPermitted {
        op: op.into(),
        why: "no lease: send hello first".into(),
    })?;
    let kind = st.leases.kind(lease).ok_or_else(|| Error::NotPermitted {
        op: op.into(),
        why: "lease has ended".into(),
    })?;
    Ok((lease, kind))
}

/// Refuses a writer's request made under a reader's lease.
fn require_writer(kind: LeaseKind, op: &str) -> Result<()> {
    if kind == LeaseKind::Rw {
        return Ok(());
    }
    Err(Error::NotPermitted {
        op: op.into(),
        why: format!("needs the rw lease; this lease is {kind}"),
    })
}

/// The store a lease of `kind` reads: the working one for the writer, the
/// committed one for a reader.
fn store_for<'s>(st: &'s State, kind: LeaseKind, op: &str) -> Result<&'s Store> {
    match kind {
        LeaseKind::Rw => st.working.as_ref(),
        LeaseKind::Ro => st.committed.as_ref(),
    }
    .ok_or_else(|| no_store(op))
}

fn no_store(op: &str) -> Error {
    Error::NoLayout(format!("nothing to read for '{op}'"))
}
