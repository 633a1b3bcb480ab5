//! An LLM agent turn whose tool calls are `#[idempotent]` functions: the transport back to the
//! model drops replies, the agent loop retries the whole turn, and still every tool's side effect
//! happens once.
//!
//! ```text
//! cargo run -p idempotent-examples --bin agent_pipeline  # SQLite file (the embedded default)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin agent_pipeline  # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin agent_pipeline  # PostgreSQL
//! RUN_ID=turn-1 cargo run ... # run twice with one RUN_ID: the second run replays every tool
//! RUST_LOG=idempotent_core=debug cargo run ... # the executor's events (acquired, replayed, ...)
//! ```
//!
//! The planner (a stand-in for the model) reads the customer's message and picks three tool
//! calls: `issue_refund`, `send_email`, `create_ticket`. After each tool, the loop sends the result
//! back to the model over a flaky transport; when a send fails, the loop retries the turn from
//! the top, re-planning and calling every tool again under the same run id. The tools replay
//! what they did the first time instead of refunding, emailing or filing again.
//!
//! Things to notice in the tool definitions:
//! - the run context is an ordinary parameter, so callers look the same with or without the macro;
//! - clients (`payments`, `mailer`, `tracker`) are `skip`ped: they are handles, not data;
//! - the model words the email differently on every attempt, so `send_email` skips `body` and is
//!   keyed on who gets which template;
//! - `issue_refund` is keyed on the order (`key(order_id)`) and fingerprints the amount, so a
//!   confused planner that asks for another amount on the same order is refused, not obeyed.

use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_core::{Error, RunContext, current_attempt, idempotent};
use serde::{Deserialize, Serialize};

// ---- the outside world: every call to these is a real side effect ----

#[derive(Default)]
struct PaymentProvider {
    refunds: AtomicU32,
}

#[derive(Default)]
struct Mailer {
    sent: AtomicU32,
}

#[derive(Default)]
struct Tracker {
    tickets: AtomicU32,
}

/// Drops the reply of the listed sends (1-based, counted over the whole run), like a socket
/// reset after the request was processed.
struct FlakyTransport {
    sends: AtomicU32,
    drop_sends: &'static [u32],
}

impl FlakyTransport {
    async fn send_to_model(&self, tool: &str) -> Result<(), String> {
        let n = self.sends.fetch_add(1, Ordering::SeqCst) + 1;
        if self.drop_sends.contains(&n) {
            return Err(format!("connection reset by peer while returning {tool}'s result to the model"));
        }
        Ok(())
    }
}

// ---- the tools ----

#[derive(Debug, Clone, Serialize, Deserialize)]
struct RefundReceipt {
    refund_id: String,
    amount_cents: u64,
    /// The fencing token of the attempt that made the refund: a provider that remembers the
    /// highest fence per order can reject a stale attempt that wakes up late.
    fence: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct EmailSent {
    message_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Ticket {
    ticket_id: String,
}

#[idempotent(step = "issue_refund", retention = 86400, key(order_id), skip(payments))]
async fn issue_refund(
    ctx: &RunContext,
    payments: &PaymentProvider,
    order_id: &str,
    amount_cents: u64,
) -> Result<RefundReceipt, Error> {
    let fence = current_attempt().map_or(0, |a| a.fence());
    let n = payments.refunds.fetch_add(1, Ordering::SeqCst) + 1;
    Ok(RefundReceipt { refund_id: format!("re_{order_id}_{n}"), amount_cents, fence })
}

#[idempotent(step = "send_email", retention = 86400, skip(mailer, body))]
async fn send_email(
    ctx: &RunContext,
    mailer: &Mailer,
    to: &str,
    template: &str,
    body: &str,
) -> Result<EmailSent, Error> {
    let n = mailer.sent.fetch_add(1, Ordering::SeqCst) + 1;
    println!("      (mailer) to {to}: {body:?}");
    Ok(EmailSent { message_id: format!("msg_{template}_{n}") })
}

#[idempotent(step = "create_ticket", retention = 86400, skip(tracker))]
async fn create_ticket(
    ctx: &RunContext,
    tracker: &Tracker,
    order_id: &str,
    title: &str,
    priority: u8,
) -> Result<Ticket, Error> {
    let n = tracker.tickets.fetch_add(1, Ordering::SeqCst) + 1;
    println!("      (tracker) P{priority} {title:?} about {order_id}");
    Ok(Ticket { ticket_id: format!("BILL-{}", 100 + n) })
}

// ---- the agent ----

/// One tool call as the model emits it.
#[derive(Debug, Clone)]
enum ToolCall {
    IssueRefund { order_id: String, amount_cents: u64 },
    SendEmail { to: String, template: String, body: String },
    CreateTicket { order_id: String, title: String, priority: u8 },
}

impl ToolCall {
    fn name(&self) -> &'static str {
        match self {
            ToolCall::IssueRefund { .. } => "issue_refund",
            ToolCall::SendEmail { .. } => "send_email",
            ToolCall::CreateTicket { .. } => "create_ticket",
        }
    }
}

/// A stand-in for the model: the same plan every time, but worded differently per attempt, as a
/// sampled model would.
fn plan(message: &str, attempt: u32) -> Vec<ToolCall> {
    assert!(message.contains("1042"));
    let wording = ["We have refunded", "Good news: we refunded", "Your refund is on its way:"];
    vec![
        ToolCall::IssueRefund { order_id: "order-1042".into(), amount_cents: 1500 },
        ToolCall::SendEmail {
            to: "ada@example.com".into(),
            template: "refund_confirmation".into(),
            body: format!("{} the duplicate charge of $15.00 on order 1042.", wording[(attempt as usize - 1) % 3]),
        },
        ToolCall::CreateTicket {
            order_id: "order-1042".into(),
            title: "Duplicate charge on checkout".into(),
            priority: 2,
        },
    ]
}

struct Tools {
    payments: PaymentProvider,
    mailer: Mailer,
    tracker: Tracker,
}

impl Tools {
    fn effects(&self) -> u32 {
        self.payments.refunds.load(Ordering::SeqCst)
            + self.mailer.sent.load(Ordering::SeqCst)
            + self.tracker.tickets.load(Ordering::SeqCst)
    }

    async fn call(&self, ctx: &RunContext, call: &ToolCall) -> Result<String, Error> {
        Ok(match call {
            ToolCall::IssueRefund { order_id, amount_cents } => {
                let r = issue_refund(ctx, &self.payments, order_id, *amount_cents).await?;
                format!("{} for {} cents (fence {})", r.refund_id, r.amount_cents, r.fence)
            }
            ToolCall::SendEmail { to, template, body } => {
                send_email(ctx, &self.mailer, to, template, body).await?.message_id
            }
            ToolCall::CreateTicket { order_id, title, priority } => {
                create_ticket(ctx, &self.tracker, order_id, title, *priority).await?.ticket_id
            }
        })
    }
}

const MAX_ATTEMPTS: u32 = 5;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    idempotent_examples::logs().init();

    let (store, store_name) = idempotent_examples::store_from_env().await?;
    let run_id = std::env::var("RUN_ID").unwrap_or_else(|_| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        format!("support-4711/turn-{}", now.as_millis())
    });
    let ctx = RunContext::new(store, &run_id).tenant("acme");
    println!("store: {store_name}\nrun:   {run_id}\n");

    let message = "Order 1042 was charged twice. Please refund the duplicate $15.00, confirm by email, \
                   and open a ticket so billing looks into it.";
    println!("customer: {message}\n");

    let tools = Tools { payments: PaymentProvider::default(), mailer: Mailer::default(), tracker: Tracker::default() };
    // The replies to the 2nd send (send_email, attempt 1) and the 5th (create_ticket, attempt 2)
    // are lost.
    let transport = FlakyTransport { sends: AtomicU32::new(0), drop_sends: &[2, 5] };
    let mut tool_calls = 0;

    let mut done = false;
    for attempt in 1..=MAX_ATTEMPTS {
        println!("── attempt {attempt} ──");
        let calls = plan(message, attempt);
        let names: Vec<_> = calls.iter().map(ToolCall::name).collect();
        println!("  planner: {}", names.join(", "));
        let mut lost = None;
        for call in &calls {
            let before = tools.effects();
            let result = tools.call(&ctx, call).await?;
            tool_calls += 1;
            let how = if tools.effects() > before { "ran" } else { "replayed" };
            println!("  {:<13} {how:<8} → {result}", call.name());
            if let Err(e) = transport.send_to_model(call.name()).await {
                lost = Some(e);
                break;
            }
        }
        match lost {
            Some(e) => println!("  transport: {e}; retrying the turn\n"),
            None => {
                done = true;
                break;
            }
        }
    }
    assert!(done, "the turn did not complete within {MAX_ATTEMPTS} attempts");

    let refunds = tools.payments.refunds.load(Ordering::SeqCst);
    let emails = tools.mailer.sent.load(Ordering::SeqCst);
    let tickets = tools.tracker.tickets.load(Ordering::SeqCst);
    println!("\n── summary ──");
    println!("tool calls made by the agent loop: {tool_calls}");
    println!("side effects: refunds {refunds}, emails {emails}, tickets {tickets}");
    if refunds == 0 && emails == 0 && tickets == 0 {
        // RUN_ID named a turn that an earlier process already completed (on Redis).
        println!("every tool replayed the result of an earlier run of {run_id}; nothing happened twice");
    } else {
        assert!(refunds == 1 && emails == 1 && tickets == 1, "a side effect was repeated");
        println!("each side effect happened exactly once, although the loop called each tool up to 3 times");
    }
    println!();

    // A confused planner asks for a different amount on the same order: the refund is keyed on
    // the order, the amount is fingerprinted, so the call is refused instead of refunding again.
    println!("── a later, confused plan: refund order-1042 for $150.00 ──");
    match issue_refund(&ctx, &tools.payments, "order-1042", 15000).await {
        Err(e @ Error::Mismatch { .. }) => println!("  refused: {e}"),
        other => panic!("expected a payload mismatch, got {other:?}"),
    }
    assert_eq!(tools.payments.refunds.load(Ordering::SeqCst), refunds, "the confused refund must not run");
    Ok(())
}
