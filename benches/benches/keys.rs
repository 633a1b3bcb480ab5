//! Key derivation against its floor: `serde_json::to_vec` + sha256 of the same payload.
//!
//! Each payload size is one criterion group, so the report shows ours and the floor side by side.
//! The extra rows split the cost: canonical serialization alone, and serde_json alone.

// `criterion_group!` generates an undocumented `pub fn`.
#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use idempotent_benches::{Refund, ToolCall};
use idempotent_core::canonical::{canonicalize_json, to_canonical_vec};
use idempotent_core::{Fingerprint, Key, KeyScope, MemoryStore, RunContext};
use serde::Serialize;
use sha2::{Digest, Sha256};

fn group<P: Serialize>(c: &mut Criterion, name: &str, payload: &P) {
    let len = serde_json::to_vec(payload).unwrap().len() as u64;
    let mut g = c.benchmark_group(format!("key_derivation/{name}"));
    g.throughput(Throughput::Bytes(len));

    g.bench_function(BenchmarkId::new("floor: serde_json::to_vec + sha256", len), |b| {
        b.iter(|| {
            let json = serde_json::to_vec(black_box(payload)).unwrap();
            black_box(<[u8; 32]>::from(Sha256::digest(&json)))
        })
    });
    let scope = KeyScope::new("run-7f3a", "issue_refund");
    g.bench_function(BenchmarkId::new("ours: Fingerprint::of + Key::from_identity_hash", len), |b| {
        b.iter(|| {
            let fp = Fingerprint::of(black_box(payload)).unwrap();
            black_box(Key::from_identity_hash(&scope, &fp))
        })
    });
    let ctx = RunContext::new(MemoryStore::new(), "run-7f3a");
    g.bench_function(BenchmarkId::new("ours: ctx.step(..).key_for (executor path)", len), |b| {
        b.iter(|| black_box(ctx.step("issue_refund").key_for(black_box(payload)).unwrap()))
    });
    g.bench_function(BenchmarkId::new("part: to_canonical_vec only", len), |b| {
        b.iter(|| black_box(to_canonical_vec(black_box(payload)).unwrap()))
    });
    g.bench_function(BenchmarkId::new("part: serde_json::to_vec only", len), |b| {
        b.iter(|| black_box(serde_json::to_vec(black_box(payload)).unwrap()))
    });
    g.finish();
}

/// The HTTP layer canonicalizes JSON request bodies given as bytes. Its floor: parse into
/// `serde_json::Value` (whose maps are sorted) and write it back — what a naive canonicalization
/// would do, without the exact-integer and duplicate-member guarantees.
fn json_body<P: Serialize>(c: &mut Criterion, name: &str, payload: &P) {
    let body = serde_json::to_vec_pretty(payload).unwrap();
    let mut g = c.benchmark_group(format!("json_body/{name}"));
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.bench_function(BenchmarkId::new("floor: serde_json::from_slice::<Value> + to_vec", body.len()), |b| {
        b.iter(|| {
            let v: serde_json::Value = serde_json::from_slice(black_box(&body)).unwrap();
            black_box(serde_json::to_vec(&v).unwrap())
        })
    });
    g.bench_function(BenchmarkId::new("ours: canonical::canonicalize_json", body.len()), |b| {
        b.iter(|| black_box(canonicalize_json(black_box(&body)).unwrap()))
    });
    g.finish();
}

fn keys(c: &mut Criterion) {
    let small = Refund::new(42);
    let large = ToolCall::new(3);
    group(c, "small", &small);
    group(c, "4KiB", &large);
    json_body(c, "small", &small);
    json_body(c, "4KiB", &large);
}

criterion_group!(benches, keys);
criterion_main!(benches);
