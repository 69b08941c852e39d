//! `make bench-shim`: what our shim costs against containerd's own.
//!
//! Against one private containerd (release build of our shim), runs
//! `ctr run --rm` of a container that runs `true`, alternating between
//! `io.containerd.runc.v2` and `io.containerd.shadow.v1` (so drift on a busy
//! machine hits both alike), then prints the medians, their ratio, and the
//! resident memory of each shim while a container runs. Figures, not
//! assertions: the targets (ratio <= 1.10, shim RSS <= 8 MiB) are printed
//! next to them.
//!
//! Environment: `BENCH_RUNS` (or `--runs`; default 20, at least 20),
//! `SHADOW_SHIM_BIN`.

use clap::Parser;
use shadow_tests::{our_processes, Containerd, Runtime};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "bench-shim",
    about = "`ctr run --rm` of `true` through this shim vs io.containerd.runc.v2, interleaved; medians, ratio and shim RSS"
)]
struct Cli {
    /// Runs per runtime (at least 20).
    #[arg(long, env = "BENCH_RUNS", default_value_t = 20)]
    runs: usize,
}

const TARGET_RATIO: f64 = 1.10;
const TARGET_RSS_KIB: u64 = 8 * 1024;

fn main() {
    let Cli { runs } = Cli::parse();
    if let Err(e) = run(runs.max(20)) {
        eprintln!("bench-shim: {e}");
        std::process::exit(1);
    }
}

fn run(runs: usize) -> Result<(), Box<dyn std::error::Error>> {
    let cd = Containerd::builder()
        .shim_profile("release")
        .namespace(format!("bench-shim-{}", std::process::id()))
        .start()?;
    println!(
        "bench-shim: private containerd at {}",
        cd.address().display()
    );
    println!("bench-shim: {runs} runs per runtime of `ctr run --rm <busybox> true`, interleaved");

    let runtimes = [Runtime::RuncV2, Runtime::Shadow];
    let mut times: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut failures: [usize; 2] = [0, 0];
    let mut first_error: [Option<String>; 2] = [None, None];
    // One unrecorded warm-up each: page cache, first exec of each binary.
    for (k, rt) in runtimes.iter().enumerate() {
        let _ = once(&cd, *rt, &format!("warm-{k}"));
    }
    for i in 0..runs {
        // Alternate which goes first, so neither always follows the other.
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            let id = format!("b{i}-{k}");
            match once(&cd, runtimes[k], &id) {
                Ok(d) => times[k].push(d),
                Err(e) => {
                    failures[k] += 1;
                    first_error[k].get_or_insert(e);
                }
            }
        }
    }

    println!();
    let mut medians = [None, None];
    for (k, rt) in runtimes.iter().enumerate() {
        medians[k] = median(&mut times[k]);
        match medians[k] {
            Some(m) => println!(
                "{:<26} median {:>8.2} ms  (min {:>7.2}, max {:>7.2}, n={}, failed {})",
                rt.runtime_type(),
                ms(m),
                ms(*times[k].first().unwrap_or(&m)),
                ms(*times[k].last().unwrap_or(&m)),
                times[k].len(),
                failures[k]
            ),
            None => println!(
                "{:<26} no successful run ({} failed)",
                rt.runtime_type(),
                failures[k]
            ),
        }
        if let Some(e) = &first_error[k] {
            println!("{:<26} first error: {e}", "");
        }
    }
    if let (Some(r), Some(s)) = (medians[0], medians[1]) {
        let ratio = s.as_secs_f64() / r.as_secs_f64();
        println!(
            "median ratio shadow / runc-v2: {ratio:.3}  (target <= {TARGET_RATIO:.2}: {})",
            if ratio <= TARGET_RATIO {
                "met"
            } else {
                "NOT met"
            }
        );
    }

    println!();
    for rt in runtimes {
        match shim_rss(&cd, rt) {
            Ok(list) if !list.is_empty() => {
                for (pid, kib, anon, file) in list {
                    let verdict = if rt == Runtime::Shadow {
                        if kib <= TARGET_RSS_KIB {
                            " (target <= 8 MiB: met)"
                        } else {
                            " (target <= 8 MiB: NOT met)"
                        }
                    } else {
                        ""
                    };
                    let mib = |k: Option<u64>| {
                        k.map_or("?".into(), |k| format!("{:.2}", k as f64 / 1024.0))
                    };
                    println!(
                        "{:<26} shim pid {pid}: VmRSS {:.2} MiB (anonymous {}, file {}){verdict}",
                        rt.shim_binary(),
                        kib as f64 / 1024.0,
                        mib(anon),
                        mib(file),
                    );
                }
            }
            Ok(_) => println!(
                "{:<26} no shim process found while the container ran",
                rt.shim_binary()
            ),
            Err(e) => println!("{:<26} RSS not measured: {e}", rt.shim_binary()),
        }
    }
    cd.assert_no_leftovers();
    if times[1].is_empty() {
        return Err("no run through io.containerd.shadow.v1 succeeded".into());
    }
    Ok(())
}

fn once(cd: &Containerd, rt: Runtime, id: &str) -> Result<Duration, String> {
    let c = cd.container(rt, id).rm().cmd(&["true"]);
    let t0 = Instant::now();
    let out = c.run().map_err(|e| e.to_string())?;
    let d = t0.elapsed();
    if out.code() != 0 {
        return Err(format!("{out}"));
    }
    Ok(d)
}

/// Start an idle container, read VmRSS of the shim(s) serving it, stop it.
/// Each shim's pid, VmRSS, RssAnon and RssFile (KiB).
type Rss = (i32, u64, Option<u64>, Option<u64>);

fn shim_rss(cd: &Containerd, rt: Runtime) -> Result<Vec<Rss>, Box<dyn std::error::Error>> {
    let id = format!("rss-{}", rt.shim_binary());
    let mut run = cd
        .container(rt, &id)
        .rm()
        .cmd(&["sh", "-c", "echo ready; exec sleep 100000"])
        .spawn(false)?;
    run.wait_line(Duration::from_secs(60), |l| l == "ready")?;
    let mut found = Vec::new();
    for (pid, cmdline) in our_processes(cd.dir(), cd.address()) {
        let serves_it =
            cmdline.contains(&format!("-id {id} ")) || cmdline.ends_with(&format!("-id {id}"));
        if cmdline.contains(rt.shim_binary()) && serves_it && Some(pid as u32) != cd.pid() {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let field = |name: &str| -> Option<u64> {
                status
                    .lines()
                    .find(|l| l.starts_with(name))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
            };
            if let Some(kib) = field("VmRSS:") {
                found.push((pid, kib, field("RssAnon:"), field("RssFile:")));
            }
        }
    }
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", &id])?;
    let _ = run.wait(Duration::from_secs(60));
    Ok(found)
}

fn median(v: &mut [Duration]) -> Option<Duration> {
    if v.is_empty() {
        return None;
    }
    v.sort();
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
