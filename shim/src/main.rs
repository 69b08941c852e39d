//! `containerd-shim-shadow-v1`: the binary containerd starts for runtime type
//! `io.containerd.shadow.v1`.

fn main() {
    eprintln!("containerd-shim-shadow-v1: under construction");
    std::process::exit(1);
}
