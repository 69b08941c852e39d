//! The connections the runtime accepts (`shadow.dev/accept: runtime`) as
//! the store keeps them: each accepted connection under a name of the
//! runtime's, the engine it was handed to, and the copies a fetch gets.
//! The store's own job (systemd's protocol) is in the parent module; who
//! is handed a connection is `shadow_pair::Connections`' decision.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::sys::epoll::{EpollEvent, EpollFlags};

use super::{add, kind_of, Entry, FdStore, Kind, Recipient};

/// What [`FdStore::hand`] did with one accepted connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hand {
    /// Sent to the recipient.
    Sent,
    /// Gone from the store, or someone's already: nothing to send.
    Gone,
    /// The recipient's socket has no room now.
    Full,
    /// The recipient's socket failed (the engine died): it gets no more.
    Lost(nix::errno::Errno),
    /// This one send failed otherwise (out of memory): the connection stays
    /// in the store, to no one, and the next engine's fetch has it.
    Failed(nix::errno::Errno),
}

impl FdStore {
    /// Keeps `conn`, a connection the runtime accepted on listener
    /// `index`, under a name of its own (`accepted.<index>.<token>`): its
    /// token, or the connection back when the store is full. It is watched
    /// for nothing until an engine has it ([`FdStore::hand`]).
    pub fn accept(&mut self, index: usize, conn: OwnedFd) -> std::result::Result<u64, OwnedFd> {
        if !self.has_room() {
            return Err(conn);
        }
        let token = self.next_token;
        self.next_token += 1;
        let name = shadow_contract::handoff::accepted_name(index, token);
        // An engine may have stored under this name already (a guess of
        // the next token): its descriptors stay with it, under one name.
        self.by_name.entry(name.clone()).or_default().push(token);
        self.accepted.insert(name.clone(), None);
        self.entries.insert(
            token,
            Entry {
                name,
                fd: conn,
                polled: false,
            },
        );
        add(&self.figures.stored, 1);
        add(&self.figures.accepted, 1);
        self.moved();
        Ok(token)
    }

    /// Hands the accepted connection of `token` to `who` through `send`
    /// (given its name and descriptor; it must not block), unless it left
    /// the store or is someone's already.
    pub fn hand(
        &mut self,
        token: u64,
        who: Recipient,
        send: impl FnOnce(&str, BorrowedFd<'_>) -> nix::Result<()>,
    ) -> Hand {
        let Some(e) = self.entries.get(&token) else {
            return Hand::Gone;
        };
        if !matches!(self.accepted.get(&e.name), Some(None)) {
            return Hand::Gone;
        }
        match send(&e.name, e.fd.as_fd()) {
            Ok(()) => {
                let name = e.name.clone();
                self.mark_handed(&name, who);
                add(&self.figures.handed, 1);
                self.moved();
                Hand::Sent
            }
            Err(nix::errno::Errno::EAGAIN) => Hand::Full,
            Err(
                e @ (nix::errno::Errno::EPIPE
                | nix::errno::Errno::ECONNRESET
                | nix::errno::Errno::ENOTCONN
                | nix::errno::Errno::ECONNREFUSED),
            ) => Hand::Lost(e),
            Err(e) => Hand::Failed(e),
        }
    }

    /// `name` (an accepted connection) is `who`'s now.
    fn mark_handed(&mut self, name: &str, who: Recipient) {
        if let Some(slot) = self.accepted.get_mut(name) {
            *slot = Some(who);
        }
    }

    /// The store is full: every connection handed to an engine is watched
    /// from now on for its client closing its side (`EPOLLRDHUP`), and let
    /// go when it does, so that an engine that never removes what it was
    /// handed cannot keep the store full. Not done before: a watch costs
    /// two `epoll_ctl` and a wake-up per connection, and an engine that
    /// removes each one itself never needs it. One handed to nobody yet
    /// is not watched (its request is still to be answered).
    pub fn watch_handed(&mut self) {
        for (name, who) in &self.accepted {
            if who.is_none() {
                continue;
            }
            for token in self.by_name.get(name).into_iter().flatten() {
                if let Some(e) = self.entries.get_mut(token) {
                    if !e.polled && kind_of(e.fd.as_fd()) == Kind::Socket {
                        e.polled = self
                            .epoll
                            .add(&e.fd, EpollEvent::new(EpollFlags::EPOLLRDHUP, *token))
                            .is_ok();
                    }
                }
            }
        }
    }

    /// A fetch's copies for `who`: every descriptor but those under the
    /// name of a connection handed to `who` itself (it has them already);
    /// every accepted connection is `who`'s from then on.
    pub fn copies_for(&mut self, who: Option<Recipient>) -> Vec<(String, OwnedFd)> {
        let Some(who) = who else {
            return self.copies();
        };
        let out = self.copies_but(|name| self.accepted.get(name) == Some(&Some(who)));
        for r in self.accepted.values_mut() {
            *r = Some(who);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::OwnedFd;

    use super::*;
    use crate::pair::notify::release_now;

    fn memfd(name: &str) -> OwnedFd {
        nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap()
    }

    fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (s, c)
    }

    /// Connections the runtime accepted: handed once, never to the same
    /// engine again by its fetch, passed on whole to the engine that
    /// fetches next, and out of the store (name and all) by a remove.
    #[test]
    fn accepted_connections_go_to_one_engine_at_a_time() {
        use shadow_pair::SlotId;
        let a = Recipient {
            slot: SlotId::ZERO,
            serial: 1,
        };
        let b = Recipient {
            slot: SlotId::ONE,
            serial: 2,
        };
        let mut st = FdStore::new(3).unwrap();
        let (s1, _c1) = tcp_pair();
        let (s2, _c2) = tcp_pair();
        let t1 = st.accept(0, OwnedFd::from(s1)).unwrap();
        let t2 = st.accept(0, OwnedFd::from(s2)).unwrap();
        let n1 = shadow_contract::handoff::accepted_name(0, t1);
        let mut sent = Vec::new();
        let out = st.hand(t1, a, |name, _| {
            sent.push(name.to_string());
            Ok(())
        });
        assert_eq!(out, Hand::Sent);
        assert_eq!(sent, std::slice::from_ref(&n1));
        // Handed already: not again, to anyone.
        assert_eq!(st.hand(t1, b, |_, _| Ok(())), Hand::Gone);
        // A full socket, a dead one: nothing changes hands.
        assert_eq!(
            st.hand(t2, a, |_, _| Err(nix::errno::Errno::EAGAIN)),
            Hand::Full
        );
        assert_eq!(
            st.hand(t2, a, |_, _| Err(nix::errno::Errno::EPIPE)),
            Hand::Lost(nix::errno::Errno::EPIPE)
        );
        // A's state memfd beside its connection; one descriptor left room.
        let kept = st.store(
            format!("FDSTORE=1\nFDNAME={n1}\n").as_bytes(),
            vec![memfd("m")],
        );
        assert_eq!(kept.kept, 1);
        assert!(!st.has_room());
        let (s3, _c3) = tcp_pair();
        assert!(
            st.accept(0, OwnedFd::from(s3)).is_err(),
            "a full store takes none"
        );
        // A fetch by A leaves out what A has: connection and memfd.
        let names: Vec<String> = st.copies_for(Some(a)).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, [shadow_contract::handoff::accepted_name(0, t2)]);
        // B (A died) gets everything, and everything is B's then.
        let names: Vec<String> = st.copies_for(Some(b)).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), 3);
        assert_eq!(st.hand(t2, a, |_, _| Ok(())), Hand::Gone);
        assert!(st.copies_for(Some(b)).is_empty());
        // A remove by name takes both of its descriptors, and makes room.
        let gone = st.remove(format!("FDSTOREREMOVE=1\nFDNAME={n1}\n").as_bytes());
        assert_eq!(gone.len(), 2);
        assert!(st.has_room());
        let s = st.status();
        assert_eq!((s.fds, s.accepted, s.handed), (1, 2, 1));
        release_now(gone);
    }

    /// Once the store is full, a handed connection whose client closed its
    /// side leaves it (an engine that never removes it cannot keep the
    /// store full); one handed to nobody yet stays, its request still to
    /// be answered.
    #[test]
    fn a_full_store_lets_go_of_handed_connections_whose_client_closed() {
        let mut st = FdStore::new(2).unwrap();
        let (s1, c1) = tcp_pair();
        let (s2, c2) = tcp_pair();
        let t1 = st.accept(0, OwnedFd::from(s1)).unwrap();
        st.accept(0, OwnedFd::from(s2)).unwrap();
        let who = Recipient {
            slot: shadow_pair::SlotId::ZERO,
            serial: 1,
        };
        assert_eq!(st.hand(t1, who, |_, _| Ok(())), Hand::Sent);
        drop((c1, c2));
        // Not watched before the store is full.
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(st.hung_up().is_empty());
        assert!(!st.has_room());
        st.watch_handed();
        let gone = shadow_wait::until(
            "the closed handed connection let go",
            std::time::Duration::from_secs(5),
            std::time::Duration::from_millis(2),
            || Some(st.hung_up()).filter(|g| !g.is_empty()),
        );
        assert_eq!(gone.len(), 1);
        assert_eq!(st.status().fds, 1, "the one handed to nobody stays");
        release_now(gone);
    }
}
