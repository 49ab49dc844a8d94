//! A streamed completion's chunks from the engine's events: the one translation of
//! [`Event`]s into OpenAI's `chat.completion.chunk` / `text_completion` objects, used by the
//! server's SSE route and by the browser package (which has no HTTP in between). Tool calls
//! are parsed from each choice's text as it arrives; log-probabilities carry their byte
//! offsets.

use super::tools::{CallStream, StreamPiece};
use super::{finish_reason, Endpoint, Job, Response};
use crate::engine::Event;

/// The chunks of one streamed request with `n` choices.
pub struct ChunkStream {
    job: Job,
    /// Per choice: text bytes streamed so far (completions' `text_offset`).
    offsets: Vec<usize>,
    /// Per choice, with tools: its text parsed into content and tool-call deltas.
    calls: Vec<Option<CallStream>>,
    /// Per choice: its `Done` has been seen.
    done: Vec<bool>,
}

impl ChunkStream {
    pub fn new(job: Job, n: usize) -> ChunkStream {
        let calls = (0..n).map(|i| job.call_stream(i)).collect();
        ChunkStream { job, offsets: vec![0; n], calls, done: vec![false; n] }
    }

    pub fn job(&self) -> &Job {
        &self.job
    }

    /// Every choice has ended.
    pub fn all_done(&self) -> bool {
        self.done.iter().all(|&d| d)
    }

    /// The chunks sent before any token: chat's `role` chunk per choice.
    pub fn opening(&self) -> Vec<Response> {
        if self.job.endpoint != Endpoint::Chat {
            return Vec::new();
        }
        (0..self.done.len()).map(|i| self.job.chunk(i, None, true, None)).collect()
    }

    /// The chunks one event of choice `i` gives: its text (or tool-call deltas), and at
    /// `Done` what the tool-call parser still held and the choice's final chunk with its
    /// `finish_reason`. `Error` gives none (the caller ends the stream with the error).
    pub fn event(&mut self, i: usize, e: &Event) -> Vec<Response> {
        let (text, lp) = match e {
            Event::Token { text, logprob, .. } => (text.as_str(), logprob.as_deref()),
            Event::Text(text) => (text.as_str(), None),
            Event::Done(g) => {
                self.done[i] = true;
                return match self.calls[i].take() {
                    Some(cs) => {
                        let made = cs.calls();
                        let rest = cs.finish();
                        let made = made > 0 || rest.iter().any(|p| matches!(p, StreamPiece::Call(_)));
                        let mut out: Vec<Response> = rest.into_iter().map(|p| self.job.piece_chunk(i, p)).collect();
                        out.push(self.job.tools_finish_chunk(i, g, made));
                        out
                    }
                    None => vec![self.job.chunk(i, None, false, Some(finish_reason(g.finish_reason)))],
                };
            }
            Event::Error(_) => return Vec::new(),
        };
        if let Some(cs) = self.calls[i].as_mut() {
            return cs.push(text).into_iter().map(|p| self.job.piece_chunk(i, p)).collect();
        }
        // With logprobs every token gets its chunk (its text may be empty: part of a
        // character); without, empty pieces are not sent.
        if text.is_empty() && lp.is_none() {
            return Vec::new();
        }
        let offset = self.offsets[i];
        self.offsets[i] += lp.and_then(|t| self.job.token_bytes.as_ref().map(|w| w.get(t.id as usize).map_or(0, Vec::len))).unwrap_or(0);
        vec![self.job.chunk_with(i, Some(text), false, None, lp.map(|t| (t, offset)))]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{FinishReason, Generation};

    fn job(endpoint: Endpoint, tools: Option<super::super::tools::Tools>) -> Job {
        Job { id: "chatcmpl-1".into(), created: 1, endpoint, model: "m".into(), prompt_tokens: 3, token_bytes: None, tools }
    }

    fn done(text: &str) -> Event {
        Event::Done(Box::new(Generation {
            prompt_ids: vec![1, 2, 3],
            output_ids: vec![4],
            text: text.into(),
            finish_reason: FinishReason::Stop,
            stop_string: None,
            timings: crate::engine::metrics::RequestTimings::new(web_time::Instant::now()),
            cached_prompt_tokens: 0,
            speculative: None,
            logprobs: Vec::new(),
            host: None,
        }))
    }

    fn json(rs: &[Response]) -> Vec<serde_json::Value> {
        rs.iter().map(|r| serde_json::to_value(r).unwrap()).collect()
    }

    #[test]
    fn chat_chunks_open_with_the_role_and_end_with_the_finish_reason() {
        let mut s = ChunkStream::new(job(Endpoint::Chat, None), 2);
        let open = json(&s.opening());
        assert_eq!(open.len(), 2);
        assert_eq!(open[1]["choices"][0]["index"], 1);
        assert_eq!(open[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(s.event(0, &Event::Text(String::new())).is_empty(), "empty text without logprobs sends nothing");
        let c = json(&s.event(1, &Event::Text("Hi".into())));
        assert_eq!(c[0]["choices"][0]["delta"]["content"], "Hi");
        assert_eq!(c[0]["object"], "chat.completion.chunk");
        let end = json(&s.event(1, &done("Hi")));
        assert_eq!(end[0]["choices"][0]["finish_reason"], "stop");
        assert!(!s.all_done());
        s.event(0, &done(""));
        assert!(s.all_done());
    }

    #[test]
    fn completion_chunks_carry_text_and_no_role() {
        let mut s = ChunkStream::new(job(Endpoint::Completions, None), 1);
        assert!(s.opening().is_empty());
        let c = json(&s.event(0, &Event::Text(" world".into())));
        assert_eq!(c[0]["object"], "text_completion");
        assert_eq!(c[0]["choices"][0]["text"], " world");
    }

    #[test]
    fn tool_calls_stream_as_deltas_and_finish_as_tool_calls() {
        let body = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let tools = super::super::tools::Tools::from_request(Some(serde_json::from_value(body).unwrap()), None).unwrap().expect("tools");
        let mut s = ChunkStream::new(job(Endpoint::Chat, Some(tools)), 1);
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let mut all = Vec::new();
        for piece in text.as_bytes().chunks(7) {
            all.extend(json(&s.event(0, &Event::Text(String::from_utf8(piece.to_vec()).unwrap()))));
        }
        all.extend(json(&s.event(0, &done(text))));
        let name = all.iter().find_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"].as_str().map(str::to_string));
        assert_eq!(name.as_deref(), Some("get_weather"));
        let args: String = all.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str()).collect();
        assert_eq!(serde_json::from_str::<serde_json::Value>(&args).unwrap(), serde_json::json!({"city": "Paris"}));
        assert_eq!(all.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    }
}
