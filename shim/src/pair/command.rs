//! What the Task service asks of a pair: each Task call on a paired
//! container becomes one [`Command`] to the pair's supervisor, which owns
//! everything the pair is made of and answers on the command's reply
//! channel. Its own module, below the sender (`PairedContainer`) and the
//! receiver (`supervisor`), so that neither imports the other.

use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::types::task::ProcessInfo;
use oci_spec::runtime::LinuxResources;
use tokio::sync::oneshot;

use crate::error::Result;
use crate::status::ExitInfo;

/// Where the supervisor answers a command.
pub type Reply<T> = oneshot::Sender<Result<T>>;

/// One Task call on the pair.
#[derive(Debug)]
pub enum Command {
    /// Start both engines; the answer is the task's pid.
    Start(Reply<u32>),
    /// Signal the pair (`all`: also when it is already stopped).
    Kill {
        signal: u32,
        all: bool,
        reply: Reply<()>,
    },
    Pause(Reply<()>),
    Resume(Reply<()>),
    Update(Box<LinuxResources>, Reply<()>),
    Stats(Reply<Any>),
    /// The processes of the engines that run (before Start: the created one).
    Pids(Reply<Vec<ProcessInfo>>),
    /// Close the task's stdin.
    CloseIo(Reply<()>),
    /// Remove everything the pair is made of; the answer is its exit.
    /// The supervisor ends with it.
    Delete(Reply<ExitInfo>),
}
