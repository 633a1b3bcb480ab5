//! The rows of the run: our paths, their floors, the controls and the peer.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    OursFirst {
        heartbeat: bool,
    },
    /// `OursFirst` (heartbeat on) on a store of one connection (`pool_size(1)`).
    OursFirstOne,
    OursFirstEvalsha,
    FloorSetSet,
    /// `FloorSetSet` on one connection.
    FloorSetSetOne,
    FloorEvalEval,
    /// `FloorSetSet` again, as a row of its own: how far two measures of the same work differ
    /// in this run.
    FloorSetSetAgain,
    OursReplay,
    /// `OursReplay` on a store of one connection.
    OursReplayOne,
    FloorGet,
    /// `FloorGet` on one connection.
    FloorGetOne,
    FloorEvalGet,
    /// `FloorGet` again (see `FloorSetSetAgain`).
    FloorGetAgain,
    StoreFirst,
    StoreReplay,
    OursFirstWait,
    OursReplayWait,
    FloorSetSetWait,
    PeerFirst,
    PeerReplay,
}

impl Path {
    pub(crate) const ALL: [Path; 21] = [
        Path::OursFirst { heartbeat: true },
        Path::OursFirst { heartbeat: false },
        Path::OursFirstOne,
        Path::OursFirstEvalsha,
        Path::StoreFirst,
        Path::FloorSetSet,
        Path::FloorSetSetOne,
        Path::FloorEvalEval,
        Path::PeerFirst,
        Path::FloorSetSetAgain,
        Path::OursReplay,
        Path::OursReplayOne,
        Path::StoreReplay,
        Path::FloorGet,
        Path::FloorGetOne,
        Path::FloorEvalGet,
        Path::PeerReplay,
        Path::FloorGetAgain,
        Path::OursFirstWait,
        Path::FloorSetSetWait,
        Path::OursReplayWait,
    ];

    /// Whether the row needs the replica (`--wait`).
    pub(crate) fn waits(self) -> bool {
        matches!(self, Path::OursFirstWait | Path::OursReplayWait | Path::FloorSetSetWait)
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Path::OursFirst { heartbeat: true } => "first execution (ours, heartbeat on = default)",
            Path::OursFirst { heartbeat: false } => "first execution (ours, heartbeat off)",
            Path::OursFirstOne => "first execution (ours, pool_size 1)",
            Path::OursFirstEvalsha => "first execution (ours, scripts by EVALSHA: functions off)",
            Path::FloorSetSet => "floor: SET NX + SET (2 round trips)",
            Path::FloorSetSetOne => "floor: SET NX + SET, 1 connection",
            Path::FloorEvalEval => "floor: 2 × EVALSHA trivial SET script",
            Path::FloorSetSetAgain => "control: the SET NX + SET floor again",
            Path::OursReplay => "replay (ours)",
            Path::OursReplayOne => "replay (ours, pool_size 1)",
            Path::FloorGet => "floor: GET (1 round trip)",
            Path::FloorGetOne => "floor: GET, 1 connection",
            Path::FloorEvalGet => "floor: EVALSHA trivial GET script",
            Path::FloorGetAgain => "control: the GET floor again",
            Path::StoreFirst => "diag: RedisStore acquire + complete, no executor",
            Path::StoreReplay => "diag: RedisStore acquire (replay), no executor",
            Path::OursFirstWait => "first execution (ours, WAIT 1 replica)",
            Path::OursReplayWait => "replay (ours, WAIT 1 replica)",
            Path::FloorSetSetWait => "floor: (SET NX + WAIT 1) + (SET + WAIT 1), 2 round trips",
            Path::PeerFirst => "peer: idempotent 0.3.0 first execution",
            Path::PeerReplay => "peer: idempotent 0.3.0 replay",
        }
    }
}
