//! Prints the criterion results of the last `cargo bench` as Markdown tables, one per group, with
//! each row's median time divided by its group's floor (the row whose name starts with `floor`).
//! Delete `target/criterion` before a run whose benchmark names changed, or old rows show too.
//!
//! ```text
//! cargo bench -p idempotent-benches
//! cargo run --release -p idempotent-benches --bin criterion_table [-- target/criterion]
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

struct Bench {
    function: String,
    median_ns: f64,
    low_ns: f64,
    high_ns: f64,
}

fn find(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.ends_with("new") && p.join("estimates.json").is_file() {
                out.push(p);
            } else {
                find(&p, out);
            }
        }
    }
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn fmt_ns(ns: f64) -> String {
    if ns >= 1000.0 { format!("{:.2} µs", ns / 1000.0) } else { format!("{ns:.0} ns") }
}

fn main() {
    let root = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
        target.join("criterion")
    });
    let mut dirs = Vec::new();
    find(&root, &mut dirs);
    if dirs.is_empty() {
        eprintln!("no criterion results under {}; run `cargo bench -p idempotent-benches` first", root.display());
        std::process::exit(1);
    }
    let mut groups: BTreeMap<String, Vec<Bench>> = BTreeMap::new();
    for dir in dirs {
        let meta = read(&dir.join("benchmark.json"));
        let est = read(&dir.join("estimates.json"));
        let median = &est["median"];
        let group = meta["group_id"].as_str().unwrap_or("?").to_owned();
        let mut function = meta["function_id"].as_str().unwrap_or("?").to_owned();
        if let Some(v) = meta["value_str"].as_str() {
            function = format!("{function} ({v} B)");
        }
        groups.entry(group).or_default().push(Bench {
            function,
            median_ns: median["point_estimate"].as_f64().unwrap_or(f64::NAN),
            low_ns: median["confidence_interval"]["lower_bound"].as_f64().unwrap_or(f64::NAN),
            high_ns: median["confidence_interval"]["upper_bound"].as_f64().unwrap_or(f64::NAN),
        });
    }
    for (group, mut benches) in groups {
        benches.sort_by(|a, b| a.function.cmp(&b.function));
        // Each group has one row named `floor…`; the others are divided by it.
        let floor = benches.iter().find(|b| b.function.starts_with("floor")).map(|b| (b.function.clone(), b.median_ns));
        println!("{group}\n");
        match &floor {
            Some((name, _)) => println!("| benchmark | median | 95% CI of median | ÷ `{name}` |"),
            None => println!("| benchmark | median | 95% CI of median | |"),
        }
        println!("|---|--:|--:|--:|");
        for b in &benches {
            let ratio = floor.as_ref().map(|(_, f)| format!("{:.2}", b.median_ns / f)).unwrap_or_default();
            println!(
                "| {} | {} | {} – {} | {ratio} |",
                b.function,
                fmt_ns(b.median_ns),
                fmt_ns(b.low_ns),
                fmt_ns(b.high_ns)
            );
        }
        println!();
    }
}
