//! Requests and generation: sampling, logit bias and penalties, constrained decoding, the generation loop with
//! streaming and stop conditions, and serving metrics (TTFT, ITL, TPOT, E2E).

pub mod batch;
pub mod constraint;
pub mod generate;
pub mod logit_bias;
pub mod metrics;
pub mod sampler;
pub mod speculative;
pub mod step_costs;
#[cfg(not(target_arch = "wasm32"))]
pub mod worker;

pub use batch::{Engine, EngineOptions, EngineStats, Event, FrameBudget, FrameReport, RequestHandle};
pub use constraint::{Constraint, Guide};
pub use generate::{FinishReason, GenerateRequest, Generation};
pub use logit_bias::LogitBias;
pub use metrics::RequestTimings;
pub use sampler::{token_logprob, Sampler, SamplingParams, TokenLogprob};
pub use speculative::{Drafter, SpecStats, Speculation};
#[cfg(not(target_arch = "wasm32"))]
pub use worker::{EngineClient, EngineWorker, Snapshot};
