//! `lantern serve` as clients see it: the real binary on the real model (SmolLM2, context
//! 256, 4 sequences) on a free loopback port, driven by an HTTP client library (ureq) and,
//! where the test is about the bytes on the wire (slow clients, malformed requests, chunked
//! bodies, hanging up), by hand over `TcpStream`. Completions and chat completions (equal to `lantern run` greedy), streaming,
//! /v1/models, concurrent clients, errors (malformed JSON, unknown model, oversize prompt,
//! bad parameters, 404/405/413, the connection cap), the API key, a client that disconnects
//! mid-stream (its pages come back), and a bounded load test (16 streaming clients for 10 s
//! against a queue of 4: every request completes or gets a documented 429/503, none hangs,
//! and the engine and the process return to where they started), slow clients (hundreds of
//! connections trickling header bytes and a body trickled byte by byte do not keep a normal
//! client waiting), and SIGTERM during four streams (each ends with a final event, the
//! process exits 0 within its deadline, the queued request heard keep-alive comments).
//! Two replicas behind SGLang's model gateway (smg from PyPI): spread, cache-aware routing
//! against round robin, a replica killed or drained mid-load; and the deployment files'
//! flags, ports and probe paths against the real binary.
//!
//! The tests of this file run one at a time (each starts its own server, and lavapipe
//! shares two cores).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const MODEL_ID: &str = "SmolLM2-135M-Instruct.Q4_1";
const CONTEXT: usize = 256;

fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|e| e.into_inner())
}

/// A `lantern serve` child process, killed on drop.
struct Server {
    child: Child,
    addr: String,
    log: PathBuf,
    /// The API key the server wants (its `LANTERN_API_KEY`), sent by `get`.
    key: Option<String>,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        Self::start_with_env(extra, &[])
    }

    fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("serve-{}-{n}.log", std::process::id()));
        let log_file = std::fs::File::create(&log).expect("server log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lantern"));
        cmd.env("LANTERN_OFFLINE", "1")
            .env_remove("LANTERN_API_KEY")
            .args(["serve", "--port", "0", "--context", "256", "--model"])
            .arg(common::smollm2_gguf())
            .args(if extra.contains(&"--max-seqs") { &[][..] } else { &["--max-seqs", "4"][..] })
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start lantern serve");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(i) = line.find("listening on http://") {
                    let rest = &line[i + "listening on http://".len()..];
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                }
            }
        });
        let key = env.iter().find(|(k, _)| *k == "LANTERN_API_KEY").map(|(_, v)| v.to_string());
        let mut server = Server { child, addr: String::new(), log, key };
        match rx.recv_timeout(Duration::from_secs(180)) {
            Ok(addr) => server.addr = addr,
            Err(_) => panic!("the server did not start; its log:\n{}", server.log_text()),
        }
        server
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn get(&self, path: &str) -> Response {
        match &self.key {
            Some(key) => http(&self.addr, "GET", path, &[("Authorization", &format!("Bearer {key}"))], b""),
            None => http(&self.addr, "GET", path, &[], b""),
        }
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        http(&self.addr, "POST", path, &[("Content-Type", "application/json")], body.to_string().as_bytes())
    }

    /// The same, from a server that wants an API key.
    fn metric_with_key(&self, name: &str, key: &str) -> f64 {
        let r = http(&self.addr, "GET", "/metrics", &[("Authorization", &format!("Bearer {key}"))], b"");
        assert_eq!(r.status, 200);
        metric(&r.text(), name)
    }

    /// The value of an unlabelled sample (or a labelled one given as `name{labels}`).
    fn metric(&self, name: &str) -> f64 {
        let r = self.get("/metrics");
        assert_eq!(r.status, 200);
        metric(&r.text(), name)
    }

    /// Waits until no request runs or waits and every KV page is free.
    fn wait_idle(&self, within: Duration) -> String {
        let t0 = Instant::now();
        loop {
            let text = self.get("/metrics").text();
            let (running, waiting) = (metric(&text, "lantern_requests_running"), metric(&text, "lantern_requests_waiting"));
            let (free, total) = (metric(&text, "lantern_kv_pages_free"), metric(&text, "lantern_kv_pages_total"));
            let busy = metric(&text, "lantern_engine_busy");
            if running == 0.0 && waiting == 0.0 && free == total && busy == 0.0 {
                return text;
            }
            assert!(
                t0.elapsed() < within,
                "not idle after {within:?}: running {running}, waiting {waiting}, KV pages free {free} of {total}, busy {busy}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- server log ({}) ---\n{}", self.log.display(), self.log_text());
        }
    }
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("status {}: not JSON ({e}): {}", self.status, self.text()))
    }

    /// The `data:` payloads of a server-sent-event body (comments skipped).
    fn events(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter(|e| !e.trim().is_empty() && !e.starts_with(':'))
            .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data event: {e:?}")).to_string())
            .collect()
    }
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    s
}

fn write_request(s: &mut TcpStream, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8], close: bool) {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n", body.len());
    if close {
        req.push_str("Connection: close\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    s.write_all(&bytes).expect("send request");
}

/// One request through an HTTP client library (ureq; its own connection pool per call).
fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .max_idle_connections(0)
        .build()
        .into();
    let mut b = ureq::http::Request::builder().method(method).uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let sent = if body.is_empty() {
        agent.run(b.body(ureq::SendBody::none()).expect("request"))
    } else {
        agent.run(b.body(body).expect("request"))
    };
    let mut r = sent.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let headers = r.headers().iter().map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string())).collect();
    let body = r.body_mut().with_config().limit(64 << 20).read_to_vec().expect("read the body");
    Response { status: r.status().as_u16(), headers, body }
}

fn read_line(r: &mut impl BufRead) -> std::io::Result<String> {
    let mut l = String::new();
    if r.read_line(&mut l)? == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed"));
    }
    Ok(l.trim_end_matches(['\r', '\n']).to_string())
}

fn read_head(r: &mut impl BufRead) -> std::io::Result<(u16, Vec<(String, String)>)> {
    let status_line = read_line(r)?;
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {status_line:?}")))?;
    let mut headers = Vec::new();
    loop {
        let l = read_line(r)?;
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').ok_or_else(|| std::io::Error::other(format!("bad header {l:?}")))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    Ok((status, headers))
}

/// One chunk of a chunked body (`None` at its end).
fn read_chunk(r: &mut impl BufRead) -> std::io::Result<Option<Vec<u8>>> {
    let size = read_line(r)?;
    let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
        .map_err(|_| std::io::Error::other(format!("bad chunk size {size:?}")))?;
    if size == 0 {
        read_line(r)?;
        return Ok(None);
    }
    let mut data = vec![0; size];
    r.read_exact(&mut data)?;
    read_line(r)?;
    Ok(Some(data))
}

fn read_response(r: &mut impl BufRead) -> std::io::Result<Response> {
    let (status, headers) = read_head(r)?;
    let mut resp = Response { status, headers, body: Vec::new() };
    if resp.header("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        while let Some(c) = read_chunk(r)? {
            resp.body.extend_from_slice(&c);
        }
    } else if let Some(n) = resp.header("content-length") {
        let n: usize = n.parse().map_err(|_| std::io::Error::other("bad content-length"))?;
        resp.body = vec![0; n];
        r.read_exact(&mut resp.body)?;
    } else {
        r.read_to_end(&mut resp.body)?;
    }
    Ok(resp)
}

/// `lantern run --json` on the same model and context: the reference output.
fn lantern_run(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_lantern"))
        .env("LANTERN_OFFLINE", "1")
        .args(["run", "--json", "--context", "256", "--model"])
        .arg(common::smollm2_gguf())
        .args(args)
        .output()
        .expect("lantern run");
    assert!(out.status.success(), "lantern run: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("lantern run --json prints JSON")
}

/// The error object of an OpenAI-shaped error response.
fn error_of(r: &Response) -> Value {
    let v = r.json();
    let e = v["error"].clone();
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "no error message: {v}");
    assert!(e["type"].as_str().is_some(), "no error type: {v}");
    e
}

#[test]
fn completion_and_chat_equal_lantern_run_greedy() {
    let _s = serial();
    let server = Server::start(&[]);
    let run = lantern_run(&["--max-tokens", "6", "Once upon a time"]);
    let r = server.post("/v1/completions", &json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("content-type").unwrap().starts_with("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["model"], MODEL_ID);
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(c["text"], run["text"], "server vs lantern run");
    let prompt_tokens = run["prompt_ids"].as_array().unwrap().len() as u64;
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(prompt_tokens));
    assert_eq!(v["usage"]["completion_tokens"], 6);
    assert_eq!(v["usage"]["total_tokens"].as_u64(), Some(prompt_tokens + 6));

    // logit_bias and the penalties: banning the first token, with repeats penalised, gives
    // what `lantern run` gives with the same options (and not the unbiased text).
    let first = run["output_ids"][0].as_u64().unwrap();
    let biased = lantern_run(&[
        "--max-tokens",
        "6",
        "--logit-bias",
        &format!("{first}=-100"),
        "--frequency-penalty",
        "1.5",
        "--presence-penalty",
        "0.5",
        "Once upon a time",
    ]);
    assert_ne!(biased["output_ids"][0], run["output_ids"][0], "the banned token");
    let r = server.post(
        "/v1/completions",
        &json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                "logit_bias": {first.to_string(): -100}, "frequency_penalty": 1.5, "presence_penalty": 0.5}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["text"], biased["text"], "biased: server vs lantern run");

    // The prompt as token ids, and the model named by its path: the same text.
    let ids = run["prompt_ids"].clone();
    let path = common::smollm2_gguf().display().to_string();
    let r = server.post("/v1/completions", &json!({"model": path, "prompt": ids, "max_tokens": 6, "temperature": 0}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["text"], run["text"]);

    // Chat: the model's template, stopped by its end-of-turn token.
    let question = "What is the capital of France?";
    let run = lantern_run(&["--chat", "--max-tokens", "12", question]);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(c["message"]["content"], run["text"], "server vs lantern run --chat");
    let finish = if run["finish_reason"] == "stop" { "stop" } else { "length" };
    assert_eq!(c["finish_reason"], finish);
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(run["prompt_ids"].as_array().unwrap().len() as u64));
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(run["output_ids"].as_array().unwrap().len() as u64));
    // The same question as a list of text parts; max_completion_tokens wins over max_tokens.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}],
                "max_tokens": 1, "max_completion_tokens": 12, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["message"]["content"], run["text"]);
    // A stop string cuts the text before it.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": question}], "max_tokens": 12,
                "temperature": 0, "stop": [" of"]}),
    );
    let text = run["text"].as_str().unwrap();
    let want = &text[..text.find(" of").expect("the reference answer has \" of\"")];
    assert_eq!(r.json()["choices"][0]["message"]["content"], want);
    assert_eq!(r.json()["choices"][0]["finish_reason"], "stop");
}

#[test]
fn streaming_chunks_concatenate_to_the_same_text() {
    let _s = serial();
    let server = Server::start(&[]);
    let body = json!({"model": MODEL_ID, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0});
    let full = server.post("/v1/completions", &body).json();
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let r = server.post("/v1/completions", &sbody);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.len() >= 3, "{chunks:?}");
    let mut text = String::new();
    let mut finish = None;
    for c in &chunks {
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["id"], chunks[0]["id"]);
        if let Some(choice) = c["choices"].as_array().and_then(|a| a.first()) {
            text.push_str(choice["text"].as_str().unwrap());
            if !choice["finish_reason"].is_null() {
                finish = Some(choice["finish_reason"].clone());
            }
        }
    }
    assert_eq!(text, full["choices"][0]["text"].as_str().unwrap());
    assert_eq!(finish, Some(json!("length")));
    let usage = &chunks.last().unwrap()["usage"];
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage[k], full["usage"][k], "the usage chunk's {k}");
    }

    // Chat: a role delta first, content deltas, a final chunk with finish_reason, [DONE].
    let msgs = json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]);
    let full = server.post("/v1/chat/completions", &json!({"model": MODEL_ID, "messages": msgs, "max_tokens": 8, "temperature": 0}));
    let full = full.json();
    let r = server
        .post("/v1/chat/completions", &json!({"model": MODEL_ID, "messages": msgs, "max_tokens": 8, "temperature": 0, "stream": true}));
    assert_eq!(r.status, 200);
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, full["choices"][0]["message"]["content"].as_str().unwrap());
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], full["choices"][0]["finish_reason"]);
    assert_eq!(last["delta"], json!({}));
}

#[test]
fn models_health_and_request_errors() {
    let _s = serial();
    let server = Server::start(&["--max-connections", "4"]);
    let r = server.get("/v1/models");
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL_ID);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["owned_by"], "lantern");
    assert!(v["data"][0]["created"].as_u64().is_some());
    assert_eq!(server.get(&format!("/v1/models/{MODEL_ID}")).json()["id"], MODEL_ID);
    assert_eq!(error_of(&server.get("/v1/models/nope"))["code"], "model_not_found");
    let h = server.get("/health");
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");
    assert_eq!(server.get("/healthz").status, 200);

    // Malformed JSON, a body that is not an object, missing fields.
    let r = http(&server.addr, "POST", "/v1/completions", &[], b"{\"model\": ");
    assert_eq!(r.status, 400);
    assert_eq!(error_of(&r)["type"], "invalid_request_error");
    assert_eq!(error_of(&r)["code"], "invalid_json");
    assert_eq!(http(&server.addr, "POST", "/v1/completions", &[], b"[1, 2]").status, 400);
    assert_eq!(http(&server.addr, "POST", "/v1/chat/completions", &[], b"").status, 400);
    let r = server.post("/v1/completions", &json!({"model": MODEL_ID}));
    assert_eq!((r.status, error_of(&r)["param"].clone()), (400, json!("prompt")));
    let r = server.post("/v1/completions", &json!({"prompt": "hi"}));
    assert_eq!((r.status, error_of(&r)["param"].clone()), (400, json!("model")));
    let r = server.post("/v1/chat/completions", &json!({"model": MODEL_ID, "messages": []}));
    assert_eq!((r.status, error_of(&r)["param"].clone()), (400, json!("messages")));
    let r = server.post("/v1/chat/completions", &json!({"model": MODEL_ID, "messages": [{"content": "hi"}]}));
    assert_eq!(r.status, 400);

    // Unknown model.
    let r = server.post("/v1/completions", &json!({"model": "gpt-4", "prompt": "hi"}));
    assert_eq!(r.status, 404);
    let e = error_of(&r);
    assert_eq!(
        (e["type"].as_str(), e["param"].as_str(), e["code"].as_str()),
        (Some("invalid_request_error"), Some("model"), Some("model_not_found"))
    );

    // A prompt longer than the context: 400 naming both numbers.
    let long = "word ".repeat(400);
    let r = server.post("/v1/completions", &json!({"model": MODEL_ID, "prompt": long}));
    assert_eq!(r.status, 400);
    let e = error_of(&r);
    assert_eq!(e["code"], "context_length_exceeded");
    let msg = e["message"].as_str().unwrap();
    let numbers: Vec<usize> = msg.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
    assert!(numbers.contains(&CONTEXT) && numbers.iter().any(|&n| n > CONTEXT), "{msg}");
    let r = server.post("/v1/chat/completions", &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": long}]}));
    assert_eq!((r.status, error_of(&r)["code"].clone()), (400, json!("context_length_exceeded")));

    // Parameters out of range or unsupported.
    for bad in [
        json!({"n": 5}),
        json!({"n": 0}),
        json!({"temperature": 3}),
        json!({"temperature": "hot"}),
        json!({"top_p": 0}),
        json!({"max_tokens": -1}),
        json!({"max_tokens": 1.5}),
        json!({"stop": 7}),
        json!({"echo": true}),
        json!({"logprobs": 30}),
        json!({"top_logprobs": 2}),
        json!({"presence_penalty": 2.5}),
        json!({"frequency_penalty": -3}),
        json!({"logit_bias": {"42": 500}}),
        json!({"logit_bias": {"forty-two": 5}}),
        json!({"logit_bias": {"99999999": 5}}),
        json!({"stream": "yes"}),
        json!({"prompt": ""}),
        json!({"prompt": [1, 2, 99999999]}),
        json!({"prompt": ["a", "b"]}),
        json!({"prompt": {"text": "x"}}),
    ] {
        let mut body = json!({"model": MODEL_ID, "prompt": "hi", "max_tokens": 1});
        for (k, v) in bad.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        error_of(&r);
    }

    // Routes, methods, sizes.
    let r = server.get("/v2/nothing");
    assert_eq!((r.status, error_of(&r)["code"].clone()), (404, json!("not_found")));
    let r = server.get("/v1/completions");
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("POST"));
    let r = http(&server.addr, "DELETE", "/v1/models", &[], b"");
    assert_eq!(r.status, 405);
    // A declared body over the 4 MiB cap is refused before it is sent.
    let mut s = connect(&server.addr);
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n").unwrap();
    let r = read_response(&mut BufReader::new(s)).unwrap();
    assert_eq!(r.status, 413);
    error_of(&r);
    // A request that is not HTTP.
    let mut s = connect(&server.addr);
    s.write_all(b"hello there\r\n\r\n").unwrap();
    assert_eq!(read_response(&mut BufReader::new(s)).unwrap().status, 400);

    // A chunked request body, and two requests on one keep-alive connection.
    let body = json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "temperature": 0}).to_string();
    let mut s = connect(&server.addr);
    let (a, b) = body.split_at(10);
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
        a.len(),
        b.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut reader = BufReader::new(s.try_clone().unwrap());
    let r = read_response(&mut reader).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 1);
    write_request(&mut s, "GET", "/health", &[], b"", false);
    assert_eq!(read_response(&mut reader).unwrap().status, 200);
    drop((s, reader));

    // At --max-connections (4), connections without a request in flight make room: four
    // silent ones do not keep a client out (the oldest is closed).
    std::thread::sleep(Duration::from_millis(300));
    let mut silent: Vec<TcpStream> = (0..4).map(|_| connect(&server.addr)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    assert_eq!(server.get("/health").status, 200);
    assert!(t0.elapsed() < Duration::from_secs(5));
    let mut b = [0u8; 1];
    assert_eq!(silent[0].read(&mut b).unwrap_or(0), 0, "the oldest silent connection is closed");
    drop(silent);
    // When every connection has a request in flight: 503 at once with a reason.
    let long = json!({"model": MODEL_ID, "prompt": "1, 2, 3,", "max_tokens": 200, "temperature": 0, "stream": true}).to_string();
    let mut busy = Vec::new();
    for _ in 0..4 {
        let mut s = connect(&server.addr);
        write_request(&mut s, "POST", "/v1/completions", &[], long.as_bytes(), false);
        let mut r = BufReader::new(s);
        assert_eq!(read_head(&mut r).unwrap().0, 200);
        busy.push(r);
    }
    let t0 = Instant::now();
    let mut s = connect(&server.addr);
    write_request(&mut s, "GET", "/health", &[], b"", true);
    let r = read_response(&mut BufReader::new(s)).unwrap();
    assert_eq!(r.status, 503);
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(error_of(&r)["code"], "too_many_connections");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(busy);
    // Until the server has seen the four streams close, a probe may get 503 too (a slow CI
    // machine): each such refusal is counted, so count them here as well.
    let t0 = Instant::now();
    let mut refused = 1.0;
    while server.get("/health").status != 200 {
        refused += 1.0;
        assert!(t0.elapsed() < Duration::from_secs(10), "connections not released");
        std::thread::sleep(Duration::from_millis(100));
    }
    server.wait_idle(Duration::from_secs(10));
    // The errors were counted.
    let text = server.get("/metrics").text();
    assert!(metric(&text, "lantern_requests_total{outcome=\"rejected\"}") >= 18.0);
    assert_eq!(metric(&text, "lantern_requests_total{outcome=\"too_many_connections\"}"), refused);
    assert!(metric(&text, "lantern_http_connections_evicted_total") >= 1.0);
    assert_eq!(metric(&text, "lantern_requests_total{outcome=\"cancelled\"}"), 4.0);
    assert!(metric(&text, "lantern_http_responses_total{route=\"/v1/completions\",code=\"404\"}") >= 1.0);
}

#[test]
fn api_key_is_required_everywhere_but_health() {
    let _s = serial();
    let key = "sk-test-0123456789";
    let server = Server::start_with_env(&[], &[("LANTERN_API_KEY", key)]);
    let auth = format!("Bearer {key}");
    let completion = json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "temperature": 0}).to_string();
    let mut refusals = Vec::new();
    for (method, path, body) in [
        ("GET", "/v1/models", ""),
        ("GET", "/metrics", ""),
        ("POST", "/v1/completions", completion.as_str()),
        ("POST", "/v1/chat/completions", "{}"),
        ("GET", "/no/such/route", ""),
    ] {
        for headers in
            [vec![], vec![("Authorization", "Bearer wrong")], vec![("Authorization", key)], vec![("Authorization", "Basic eDp5")]]
        {
            let r = http(&server.addr, method, path, &headers, body.as_bytes());
            assert_eq!(r.status, 401, "{method} {path} {headers:?}");
            assert_eq!(r.header("www-authenticate"), Some("Bearer"));
            refusals.push(r.text());
        }
    }
    // Every refusal is the same: no hint of what was wrong.
    assert!(refusals.iter().all(|t| t == &refusals[0]), "{refusals:?}");
    assert!(!refusals[0].contains(key) && !refusals[0].contains("wrong"), "{}", refusals[0]);
    assert_eq!(http(&server.addr, "GET", "/health", &[], b"").status, 200);
    assert_eq!(http(&server.addr, "GET", "/healthz", &[], b"").status, 200);
    assert_eq!(http(&server.addr, "GET", "/v1/models", &[("Authorization", &auth)], b"").status, 200);
    assert_eq!(http(&server.addr, "GET", "/metrics", &[("authorization", &format!("bearer {key}"))], b"").status, 200);
    let r = http(&server.addr, "POST", "/v1/completions", &[("Authorization", &auth)], completion.as_bytes());
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn concurrent_clients_all_complete() {
    let _s = serial();
    let server = Server::start(&[]);
    let prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "In the beginning"];
    let addr = server.addr.clone();
    let threads: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let addr = addr.clone();
            let body = json!({"model": MODEL_ID, "prompt": p, "max_tokens": 6, "temperature": 0, "stream": i % 2 == 1});
            std::thread::spawn(move || {
                let r = http(&addr, "POST", "/v1/completions", &[], body.to_string().as_bytes());
                assert_eq!(r.status, 200, "{}", r.text());
                if i % 2 == 1 {
                    let ev = r.events();
                    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
                    ev[..ev.len() - 1]
                        .iter()
                        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
                        .collect::<String>()
                } else {
                    let v = r.json();
                    assert_eq!(v["usage"]["completion_tokens"], 6);
                    v["choices"][0]["text"].as_str().unwrap().to_string()
                }
            })
        })
        .collect();
    let texts: Vec<String> = threads.into_iter().map(|t| t.join().expect("client")).collect();
    assert!(texts.iter().all(|t| !t.is_empty()), "{texts:?}");
    let text = server.wait_idle(Duration::from_secs(10));
    assert_eq!(metric(&text, "lantern_requests_total{outcome=\"length\"}"), 4.0);
    assert_eq!(metric(&text, "lantern_completion_tokens_total"), 24.0);
    assert_eq!(metric(&text, "lantern_time_to_first_token_seconds_count"), 4.0);
    assert_eq!(metric(&text, "lantern_time_per_output_token_seconds_count"), 4.0);
    assert_eq!(metric(&text, "lantern_e2e_request_latency_seconds_count"), 4.0);
}

#[test]
fn client_disconnect_frees_its_pages() {
    let _s = serial();
    let server = Server::start(&[]);
    let total = server.metric("lantern_kv_pages_total");
    // Mid-stream: read the first token, then hang up.
    let body = json!({"model": MODEL_ID, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 200, "temperature": 0, "stream": true});
    let mut s = connect(&server.addr);
    write_request(&mut s, "POST", "/v1/completions", &[], body.to_string().as_bytes(), false);
    let mut r = BufReader::new(s);
    let (status, _) = read_head(&mut r).unwrap();
    assert_eq!(status, 200);
    let first = read_chunk(&mut r).unwrap().expect("a first event");
    assert!(first.starts_with(b"data: {"), "{}", String::from_utf8_lossy(&first));
    let first = String::from_utf8_lossy(&first).into_owned();
    let first: Value = serde_json::from_str(first.trim_start_matches("data: ").trim_end()).expect("a JSON event");
    assert!(first["choices"][0]["text"].is_string(), "{first}");
    // The engine publishes its snapshot just after the step that sent the token.
    let t0 = Instant::now();
    loop {
        let text = server.get("/metrics").text();
        if metric(&text, "lantern_requests_running") == 1.0 && metric(&text, "lantern_kv_pages_free") < total {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(2), "the request does not run (first event {first}):\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(r);
    let t0 = Instant::now();
    let text = server.wait_idle(Duration::from_secs(10));
    eprintln!("pages free {:?} after the disconnect", t0.elapsed());
    assert_eq!(metric(&text, "lantern_requests_total{outcome=\"cancelled\"}"), 1.0);
    assert!(metric(&text, "lantern_engine_output_tokens_total") < 100.0);

    // Waiting for a whole (non-streamed) answer, then hanging up.
    let mut body = body;
    body["stream"] = json!(false);
    let mut s = connect(&server.addr);
    write_request(&mut s, "POST", "/v1/completions", &[], body.to_string().as_bytes(), false);
    let t0 = Instant::now();
    while server.metric("lantern_requests_running") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the request never ran");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(s);
    let text = server.wait_idle(Duration::from_secs(10));
    assert_eq!(metric(&text, "lantern_requests_total{outcome=\"cancelled\"}"), 2.0);
    assert_eq!(metric(&text, "lantern_http_responses_total{route=\"/v1/completions\",code=\"499\"}"), 1.0);
    assert_eq!(metric(&text, "lantern_requests_total{outcome=\"length\"}"), 0.0);
}

/// What one load-test request ended as.
#[derive(Debug)]
enum Outcome {
    Completed,
    Overloaded,
    Unavailable,
    /// The client hung up on purpose after the first event.
    Abandoned,
    Failed(#[allow(dead_code)] String),
}

fn load_request(addr: &str, body: &Value, abandon: bool) -> Outcome {
    let mut s = match TcpStream::connect(addr) {
        Ok(s) => s,
        Err(e) => return Outcome::Failed(format!("connect: {e}")),
    };
    // Nothing may hang: a read waits 60 s at most (a request takes well under 10 s).
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write_request(&mut s, "POST", "/v1/completions", &[], body.to_string().as_bytes(), true);
    let mut r = BufReader::new(s);
    let (status, headers) = match read_head(&mut r) {
        Ok(h) => h,
        Err(e) => return Outcome::Failed(format!("reading the head: {e}")),
    };
    if status == 429 || status == 503 {
        let resp = match read_response_body(&mut r, status, headers) {
            Ok(resp) => resp,
            Err(e) => return Outcome::Failed(format!("reading a {status}: {e}")),
        };
        let reason = serde_json::from_slice::<Value>(&resp.body).ok().and_then(|v| v["error"]["message"].as_str().map(String::from));
        if reason.is_none_or(|m| m.is_empty()) || resp.header("retry-after").is_none() {
            return Outcome::Failed(format!("{status} without a reason or Retry-After: {}", resp.text()));
        }
        return if status == 429 { Outcome::Overloaded } else { Outcome::Unavailable };
    }
    if status != 200 {
        return Outcome::Failed(format!("status {status}"));
    }
    let mut finish = None;
    let mut events = 0;
    loop {
        match read_chunk(&mut r) {
            Ok(Some(c)) => {
                let t = String::from_utf8_lossy(&c).into_owned();
                let Some(payload) = t.strip_prefix("data: ").map(str::trim_end) else {
                    return Outcome::Failed(format!("not an event: {t:?}"));
                };
                events += 1;
                if abandon {
                    return Outcome::Abandoned;
                }
                if payload == "[DONE]" {
                    continue;
                }
                let v: Value = match serde_json::from_str(payload) {
                    Ok(v) => v,
                    Err(e) => return Outcome::Failed(format!("bad event {payload:?}: {e}")),
                };
                if v.get("error").is_some() {
                    return Outcome::Failed(format!("error event {v}"));
                }
                if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                    finish = Some(f.to_string());
                }
            }
            Ok(None) => break,
            Err(e) => return Outcome::Failed(format!("after {events} events: {e}")),
        }
    }
    match finish.as_deref() {
        Some("length") | Some("stop") => Outcome::Completed,
        f => Outcome::Failed(format!("stream ended with finish_reason {f:?}")),
    }
}

fn read_response_body(r: &mut impl BufRead, status: u16, headers: Vec<(String, String)>) -> std::io::Result<Response> {
    let mut resp = Response { status, headers, body: Vec::new() };
    let n: usize = resp.header("content-length").and_then(|n| n.parse().ok()).unwrap_or(0);
    resp.body = vec![0; n];
    r.read_exact(&mut resp.body)?;
    Ok(resp)
}

#[test]
fn bounded_load_test_loses_nothing_and_returns_to_idle() {
    let _s = serial();
    let server = Server::start(&["--max-waiting", "4", "--quiet"]);
    // Warm up (pipelines, allocator), then take the baseline.
    let r = server.post("/v1/completions", &json!({"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0}));
    assert_eq!(r.status, 200, "{}", r.text());
    let base = server.wait_idle(Duration::from_secs(10));
    let (rss0, threads0) = (metric(&base, "process_resident_memory_bytes"), metric(&base, "process_threads"));
    let finished0 = metric(&base, "lantern_requests_total{outcome=\"length\"}") + metric(&base, "lantern_requests_total{outcome=\"stop\"}");

    let prompts = [
        "Once upon a time",
        "The capital of France is",
        "List three fruits:",
        "def add(a, b):",
        "Write a haiku about the sea.",
        "Why is the sky blue?",
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    let clients: Vec<_> = (0..16)
        .map(|c| {
            let addr = server.addr.clone();
            std::thread::spawn(move || {
                let mut outcomes = Vec::new();
                let mut i = 0usize;
                while Instant::now() < deadline {
                    let sampled = (c + i).is_multiple_of(3);
                    let body = json!({
                        "model": MODEL_ID,
                        "prompt": prompts[(c * 7 + i) % prompts.len()],
                        "max_tokens": 4 + (c + i) % 5,
                        "temperature": if sampled { 0.8 } else { 0.0 },
                        "seed": i,
                        "stream": true,
                    });
                    let abandon = (c + i) % 7 == 3;
                    let o = load_request(&addr, &body, abandon);
                    if matches!(o, Outcome::Overloaded | Outcome::Unavailable) {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    outcomes.push(o);
                    i += 1;
                }
                outcomes
            })
        })
        .collect();
    let outcomes: Vec<Outcome> = clients.into_iter().flat_map(|t| t.join().expect("client thread")).collect();
    let count = |f: fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count();
    let completed = count(|o| matches!(o, Outcome::Completed));
    let overloaded = count(|o| matches!(o, Outcome::Overloaded));
    let unavailable = count(|o| matches!(o, Outcome::Unavailable));
    let abandoned = count(|o| matches!(o, Outcome::Abandoned));
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| matches!(o, Outcome::Failed(_))).collect();
    eprintln!(
        "load: {} requests: {completed} completed, {overloaded} x 429, {unavailable} x 503, {abandoned} abandoned, {} failed",
        outcomes.len(),
        failed.len()
    );
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(completed >= 8, "only {completed} requests completed");
    assert!(overloaded > 0, "16 clients against 4 sequences + 4 queued never saw a 429");

    // Back to idle, nothing lost: every accepted request is accounted for by the server
    // (a connection thread may record its request's end a moment after the engine's step).
    server.wait_idle(Duration::from_secs(20));
    let t0 = Instant::now();
    loop {
        let text = server.get("/metrics").text();
        let finished = metric(&text, "lantern_requests_total{outcome=\"length\"}")
            + metric(&text, "lantern_requests_total{outcome=\"stop\"}")
            - finished0;
        let cancelled = metric(&text, "lantern_requests_total{outcome=\"cancelled\"}");
        let open = metric(&text, "lantern_http_connections_open");
        if finished + cancelled == (completed + abandoned) as f64 && open == 1.0 {
            assert!(finished >= completed as f64);
            assert_eq!(metric(&text, "lantern_requests_total{outcome=\"overloaded\"}"), overloaded as f64);
            assert_eq!(metric(&text, "lantern_requests_total{outcome=\"error\"}"), 0.0);
            assert_eq!(metric(&text, "lantern_requests_total{outcome=\"timeout\"}"), 0.0);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "server counts finished {finished} + cancelled {cancelled} != {completed} completed + {abandoned} abandoned, or {open} connections open"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Memory and threads return to where they were (connection threads ended, nothing
    // kept per request).
    let t0 = Instant::now();
    loop {
        let text = server.get("/metrics").text();
        let (rss, threads) = (metric(&text, "process_resident_memory_bytes"), metric(&text, "process_threads"));
        if threads <= threads0 && rss <= rss0 + 64.0 * 1048576.0 {
            eprintln!("resident memory {:.1} MiB -> {:.1} MiB, threads {threads0} -> {threads}", rss0 / 1048576.0, rss / 1048576.0);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "resident memory {:.1} MiB -> {:.1} MiB, threads {threads0} -> {threads}",
            rss0 / 1048576.0,
            rss / 1048576.0
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // And it still serves.
    let r = server.post("/v1/completions", &json!({"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0}));
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json()["choices"][0]["text"],
        server.post("/v1/completions", &json!({"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0})).json()["choices"]
            [0]["text"]
    );
}

#[test]
fn speculative_decoding_per_server_and_per_request() {
    let _s = serial();
    // Lookup for every request by default.
    let server = Server::start(&["--lookup"]);
    let prompt = "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return a + b + c\n\n# the same again:\ndef add(a, b):";
    let run = lantern_run(&["--max-tokens", "24", prompt]);
    let spec_run = lantern_run(&["--max-tokens", "24", "--lookup", prompt]);
    assert_eq!(spec_run["output_ids"], run["output_ids"], "run --lookup against plain run");
    assert!(spec_run["speculative"]["proposed"].as_u64().unwrap() > 0, "{}", spec_run["speculative"]);
    let body = json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 24, "temperature": 0});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], run["text"], "speculative server against plain lantern run");
    let sp = &v["usage"]["speculative"];
    assert_eq!(sp["drafter"], "lookup");
    assert!(sp["accepted"].as_u64().unwrap() > 0, "{sp}");
    // Off for one request.
    let mut off = body.clone();
    off["speculative"] = json!({"drafter": "off"});
    let r = server.post("/v1/completions", &off);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["text"], run["text"]);
    assert!(r.json()["usage"].get("speculative").is_none());
    // A draft model the server does not have, and a malformed field: 400 naming the field.
    let mut model = body.clone();
    model["speculative"] = json!({"drafter": "model"});
    let r = server.post("/v1/completions", &model);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(error_of(&r)["message"].as_str().unwrap().contains("draft model"));
    let mut bad = body.clone();
    bad["speculative"] = json!({"draft_tokens": "many"});
    let r = server.post("/v1/completions", &bad);
    assert_eq!(r.status, 400);
    assert_eq!(error_of(&r)["param"], "speculative.draft_tokens");
    let text = server.wait_idle(Duration::from_secs(30));
    assert!(metric(&text, "lantern_speculative_accepted_tokens_total") > 0.0);
}

/// Hundreds of connections that send one header byte at a time, and one that trickles its
/// body, hold no slot a normal client needs: it is served within seconds, the tricklers are
/// cut off at the read deadline (408 for the body), and nothing is left open afterwards.
#[test]
fn slow_clients_do_not_keep_others_waiting() {
    let _s = serial();
    let server = Server::start(&["--read-timeout", "4", "--max-idle-connections", "200"]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // 300 header tricklers (more than --max-idle-connections): one byte per socket per 200 ms.
    let addr = server.addr.clone();
    let stop2 = stop.clone();
    let (connected_tx, connected) = std::sync::mpsc::channel();
    let tricklers = std::thread::spawn(move || {
        let mut socks: Vec<TcpStream> = (0..300).filter_map(|_| TcpStream::connect(&addr).ok()).collect();
        let _ = connected_tx.send(socks.len());
        let line = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        let mut i = 0;
        let mut closed = 0;
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) && i < line.len() {
            socks.retain_mut(|s| s.write_all(&line[i..i + 1]).is_ok());
            closed = 300 - socks.len();
            i += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
        closed
    });
    assert_eq!(connected.recv().unwrap(), 300);
    // A body trickled byte by byte (connected after the tricklers: the newest is not the one
    // closed to make room).
    let body = json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1}).to_string();
    let mut slow_body = connect(&server.addr);
    write!(slow_body, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len()).unwrap();
    let body_addr = body.clone();
    let mut reader = BufReader::new(slow_body.try_clone().unwrap());
    let slow_reader = std::thread::spawn(move || read_response(&mut reader).map(|r| r.status).ok());
    let slow = std::thread::spawn(move || {
        for b in body_addr.as_bytes().iter().take(40) {
            if slow_body.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        slow_reader.join().unwrap()
    });
    std::thread::sleep(Duration::from_secs(2));
    // A normal client, while all of that goes on.
    for _ in 0..3 {
        let t0 = Instant::now();
        assert_eq!(server.get("/health").status, 200);
        let r = server.post("/v1/completions", &json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "temperature": 0}));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(t0.elapsed() < Duration::from_secs(5), "a normal client waited {:?}", t0.elapsed());
        std::thread::sleep(Duration::from_millis(500));
    }
    // The body trickler is cut off at the read deadline (4 s) with 408.
    assert_eq!(slow.join().unwrap(), Some(408));
    // The header tricklers were closed: evicted beyond 200 idle, or at the read deadline.
    let closed = tricklers.join().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(closed, 300, "every header trickler is cut off");
    let text = server.wait_idle(Duration::from_secs(10));
    assert!(metric(&text, "lantern_http_connections_evicted_total") >= 100.0, "{text}");
    assert!(metric(&text, "lantern_http_connections_open") <= 2.0);
}

/// Reads one SSE stream to its end on a thread: its `data:` payloads and its comments.
fn read_stream(mut r: BufReader<TcpStream>) -> std::thread::JoinHandle<(Vec<String>, Vec<String>)> {
    std::thread::spawn(move || {
        let mut data = Vec::new();
        let mut comments = Vec::new();
        while let Ok(Some(chunk)) = read_chunk(&mut r) {
            for ev in String::from_utf8_lossy(&chunk).split("\n\n").filter(|e| !e.is_empty()) {
                match ev.strip_prefix("data: ") {
                    Some(d) => data.push(d.to_string()),
                    None => comments.push(ev.to_string()),
                }
            }
        }
        (data, comments)
    })
}

/// SIGTERM while four streams run: new requests get 503 with Retry-After, the short requests finish within the
/// deadline, the long and the queued ones are cancelled at it with a final error event, every
/// stream ends with `[DONE]`, and the process exits 0 within the deadline.
#[test]
fn sigterm_ends_every_stream_and_exits_zero() {
    let _s = serial();
    let mut server = Server::start(&["--max-seqs", "3", "--shutdown-timeout", "6", "--sse-keepalive", "1"]);
    let open = |max_tokens: usize| {
        let body = json!({"model": MODEL_ID, "prompt": "1, 2, 3, 4,", "max_tokens": max_tokens, "temperature": 0, "stream": true});
        let mut s = connect(&server.addr);
        write_request(&mut s, "POST", "/v1/completions", &[], body.to_string().as_bytes(), false);
        let mut r = BufReader::new(s);
        assert_eq!(read_head(&mut r).unwrap().0, 200);
        r
    };
    // Two short ones, one too long for the deadline, and one that waits in the queue
    // (--max-seqs 3) behind them.
    let streams: Vec<_> = [24, 24, 230, 230].into_iter().map(|n| read_stream(open(n))).collect();
    let t0 = Instant::now();
    while server.metric("lantern_requests_running") < 3.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the requests never ran");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    // Draining: new requests get 503 with Retry-After (a router retries them elsewhere), and
    // /health says so (a readiness probe takes the replica out).
    let late = server.post("/v1/completions", &json!({"model": MODEL_ID, "prompt": "x", "max_tokens": 1}));
    assert_eq!((late.status, error_of(&late)["code"].clone()), (503, json!("server_shutting_down")), "{}", late.text());
    assert!(late.header("retry-after").is_some(), "{:?}", late.headers);
    let health = server.get("/health");
    assert_eq!((health.status, health.json()["status"].clone()), (503, json!("draining")));
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "the server did not exit within its deadline");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status {status}");
    let results: Vec<_> = streams.into_iter().map(|t| t.join().unwrap()).collect();
    for (i, (data, _)) in results.iter().enumerate() {
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream {i} has no final event: {data:?}");
        let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
        if i < 2 {
            assert_eq!(last["choices"][0]["finish_reason"], "length", "stream {i}: {last}");
        } else {
            assert_eq!(last["error"]["code"], "server_shutdown", "stream {i}: {last}");
        }
    }
    // The queued request heard keep-alive comments while it waited.
    assert!(results[3].1.iter().any(|c| c.starts_with(": keep-alive")), "{:?}", results[3].1);
    let log = server.log_text();
    assert!(log.contains("SIGTERM") && log.contains("cancelling 2 requests"), "{log}");
    let pages = log.split("KV pages free: ").nth(1).and_then(|r| r.split(')').next()).unwrap_or("");
    let (free, total) = pages.split_once(" of ").unwrap_or_else(|| panic!("no page count in the log:\n{log}"));
    assert_eq!(free, total, "every KV page is free when the server stops:\n{log}");
}

/// `response_format` (json_schema, greedy and sampled; json_object) and `n` > 1: every
/// choice parses and fits the schema, and `n` choices come back with the prompt counted once.
#[test]
fn structured_output_and_parallel_choices() {
    let _s = serial();
    let server = Server::start(&[]);
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 1, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"], "additionalProperties": false},
        },
        "required": ["name", "age", "tags", "address"],
        "additionalProperties": false,
    });
    let validator = jsonschema::validator_for(&schema).expect("a valid schema");
    let format = json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}});
    for (temperature, n) in [(0.0, 1), (1.0, 2)] {
        let body = json!({
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 120,
            "temperature": temperature,
            "seed": 5,
            "n": n,
            "response_format": format,
        });
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), n);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i);
            assert_eq!(c["finish_reason"], "stop", "{c}");
            let text = c["message"]["content"].as_str().unwrap();
            let out: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
            assert!(validator.is_valid(&out), "does not fit the schema: {text}");
        }
        let completion: u64 = v["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(v["usage"]["total_tokens"].as_u64().unwrap(), v["usage"]["prompt_tokens"].as_u64().unwrap() + completion);
    }
    // json_object on completions, streamed: the concatenated text is one JSON object.
    let body = json!({"model": MODEL_ID, "prompt": "A JSON object describing a cat:", "max_tokens": 80, "temperature": 0, "stream": true,
        "response_format": {"type": "json_object"}});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200);
    let ev = r.events();
    let text: String = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object()), "{text}");
    // Greedy n = 3: three equal choices; bad formats are refused naming the field.
    let r = server.post("/v1/completions", &json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 4, "temperature": 0, "n": 3}));
    let v = r.json();
    let texts: Vec<&str> = v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts.len(), 3);
    assert!(texts.iter().all(|t| *t == texts[0]), "{texts:?}");
    assert_eq!(v["usage"]["completion_tokens"], 12);
    for bad in [json!({"type": "yaml"}), json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})] {
        let r = server.post(
            "/v1/chat/completions",
            &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "response_format": bad}),
        );
        assert_eq!((r.status, error_of(&r)["param"].clone()), (400, json!("response_format")), "{}", r.text());
    }
    server.wait_idle(Duration::from_secs(10));
}

/// The official `openai` Python client (PyPI; scripts/test.sh installs it into target/pyenv
/// and points LANTERN_PYTHON at it) drives the server unchanged: tests/clients/openai_client.py.
#[test]
fn official_openai_python_client() {
    let _s = serial();
    let python = std::env::var("LANTERN_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", "import openai"]).output();
    assert!(
        probe.as_ref().is_ok_and(|o| o.status.success()),
        "{python} cannot import openai: run scripts/test.sh (it installs the client into target/pyenv) or set LANTERN_PYTHON"
    );
    let server = Server::start(&[]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_client.py");
    let out = Command::new(&python).arg(script).arg(format!("http://{}/v1", server.addr)).arg(MODEL_ID).output().expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the openai client failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("{stdout}");
}

/// Tool calls: `tool_choice` naming a function or `required` gives `tool_calls` whose
/// arguments fit the function's parameter schema (SmolLM2's template does not take tools:
/// the system message describes them), streamed as the name then argument fragments; `auto` may answer in
/// text; bad tool fields are refused naming them.
#[test]
fn tool_calls_fit_their_parameter_schemas() {
    let _s = serial();
    let server = Server::start(&[]);
    let weather = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": false});
    let add = json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "forecast", "description": "Weather forecast", "parameters": weather}},
        {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": add}},
    ]);
    let schemas = [("forecast", jsonschema::validator_for(&weather).unwrap()), ("add", jsonschema::validator_for(&add).unwrap())];
    let check = |call: &Value| {
        let name = call["function"]["name"].as_str().unwrap();
        let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).expect("arguments are JSON");
        let v = &schemas.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("unknown function {name}")).1;
        assert!(v.is_valid(&args), "{name} arguments do not fit: {args}");
        name.to_string()
    };
    for (choice, content, stream, want) in [
        (json!({"type": "function", "function": {"name": "forecast"}}), "Weather in Oslo for 3 days?", false, Some("forecast")),
        (json!("required"), "What is 2 plus 40?", false, None),
        (json!("required"), "Weather in Rome this week?", true, None),
    ] {
        let body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 60, "temperature": 0,
            "tools": tools, "tool_choice": choice, "stream": stream});
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let (call, finish) = if stream {
            // The call's name comes first, then its arguments in fragments as they are
            // generated (OpenAI's streamed tool_calls); the last chunk says tool_calls.
            let ev = r.events();
            let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
            let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0)).collect();
            assert!(deltas.len() > 2, "arguments arrive in fragments: {deltas:?}");
            assert!(deltas[0]["function"]["name"].is_string() && deltas[0]["id"].is_string(), "{:?}", deltas[0]);
            assert!(deltas[1..].iter().all(|d| d["function"]["name"].is_null() && d["index"] == 0), "{deltas:?}");
            let args: String = deltas.iter().map(|d| d["function"]["arguments"].as_str().unwrap()).collect();
            let mut call = deltas[0].clone();
            call["function"]["arguments"] = json!(args);
            (call, chunks.last().unwrap()["choices"][0]["finish_reason"].clone())
        } else {
            let v = r.json();
            assert!(v["choices"][0]["message"]["content"].is_null(), "{v}");
            (v["choices"][0]["message"]["tool_calls"][0].clone(), v["choices"][0]["finish_reason"].clone())
        };
        assert_eq!(finish, "tool_calls");
        assert_eq!(call["type"], "function");
        let name = check(&call);
        if let Some(w) = want {
            assert_eq!(name, w);
        }
    }
    let r = server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0, "tools": tools}),
    );
    assert_eq!(r.status, 200);
    for (bad, param) in [
        (json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0]"),
        (json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}), "tools"),
        (json!({"tool_choice": "required"}), "tool_choice"),
    ] {
        let mut body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}]});
        for (k, v) in bad.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!((r.status, error_of(&r)["param"].clone()), (400, json!(param)), "{}", r.text());
    }
    server.wait_idle(Duration::from_secs(10));
}

/// The official `ollama` Python client (PyPI, installed next to `openai` by scripts/test.sh):
/// tests/clients/ollama_client.py lists, shows, chats (whole, streamed, with a JSON-schema
/// `format`) and generates; its greedy answers equal the OpenAI routes' for the same request.
#[test]
fn official_ollama_python_client() {
    let _s = serial();
    let python = std::env::var("LANTERN_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", "import ollama"]).output();
    assert!(
        probe.as_ref().is_ok_and(|o| o.status.success()),
        "{python} cannot import ollama: run scripts/test.sh (it installs the client into target/pyenv) or set LANTERN_PYTHON"
    );
    let server = Server::start(&[]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/ollama_client.py");
    let out = Command::new(&python).arg(script).arg(format!("http://{}", server.addr)).arg(MODEL_ID).output().expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the ollama client failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let got: Value = serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("the script's answers");
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(got["chat"], chat.json()["choices"][0]["message"]["content"], "/api/chat and /v1/chat/completions differ");
    let raw = server
        .post("/v1/completions", &json!({"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}));
    assert_eq!(got["raw"], raw.json()["choices"][0]["text"], "raw /api/generate and /v1/completions differ");
    server.wait_idle(Duration::from_secs(10));
}

/// Ollama's routes by hand: NDJSON lines with the final counts, the load answer to an empty
/// prompt, `/api/version` and `/api/ps`, and bad input refused with a 4xx naming the field
/// (`{"error": ...}`) before anything reaches the engine.
#[test]
fn ollama_routes_stream_ndjson_and_refuse_bad_input() {
    let _s = serial();
    let server = Server::start(&[]);
    let r = server.post(
        "/api/generate",
        &json!({"model": MODEL_ID, "prompt": "Count from one to twenty.", "options": {"temperature": 0, "num_predict": 6}}),
    );
    assert_eq!((r.status, r.header("content-type")), (200, Some("application/x-ndjson")), "{}", r.text());
    let lines: Vec<Value> = r.text().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let last = lines.last().unwrap();
    assert_eq!((last["done"].clone(), last["eval_count"].clone()), (json!(true), json!(6)), "{last}");
    assert!(last["prompt_eval_count"].as_u64().unwrap() > 3 && last["total_duration"].as_u64().unwrap() > 0, "{last}");
    assert!(lines[..lines.len() - 1].iter().all(|l| l["done"] == false && l["response"].is_string()), "{lines:?}");
    let r = server.post("/api/generate", &json!({"model": MODEL_ID, "stream": false}));
    assert_eq!(r.json()["done_reason"], "load", "{}", r.text());
    assert_eq!(server.get("/api/version").json()["version"], env!("CARGO_PKG_VERSION"));
    let ps = server.get("/api/ps").json();
    assert!(ps["models"][0]["size_vram"].as_u64().unwrap() > 0, "{ps}");
    // A decode-ahead step behind the last stream may still land.
    server.wait_idle(Duration::from_secs(10));
    let before = server.metric("lantern_engine_steps_total");
    for (path, body, status, field) in [
        ("/api/chat", json!({"messages": [{"role": "user", "content": "x"}]}), 400, "model"),
        ("/api/chat", json!({"model": "nope", "messages": []}), 404, "nope"),
        ("/api/chat", json!({"model": MODEL_ID}), 400, "messages"),
        (
            "/api/chat",
            json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "options": {"temperature": "hot"}}),
            400,
            "options.temperature",
        ),
        (
            "/api/chat",
            json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "options": {"temperature": 9}}),
            400,
            "options.temperature",
        ),
        (
            "/api/chat",
            json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "options": {"repeat_penalty": 1.3}}),
            400,
            "options.repeat_penalty",
        ),
        ("/api/chat", json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "format": 7}), 400, "format"),
        (
            "/api/chat",
            json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}),
            400,
            "messages[0].images",
        ),
        ("/api/chat", json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "think": true}), 400, "thinking"),
        ("/api/generate", json!({"model": MODEL_ID, "prompt": "x", "template": "{{ .Prompt }}"}), 400, "template"),
        ("/api/generate", json!({"model": MODEL_ID, "prompt": "x", "context": [1, 2]}), 400, "context"),
        ("/api/generate", json!({"model": MODEL_ID, "prompt": "x ".repeat(400)}), 400, "context"),
        ("/api/show", json!({}), 400, "model"),
    ] {
        let r = server.post(path, &body);
        let err = r.json()["error"].as_str().unwrap_or_else(|| panic!("{path} {body}: no error string: {}", r.text())).to_string();
        assert_eq!(r.status, status, "{path} {body}: {err}");
        assert!(err.contains(field), "{path} {body}: the error does not name {field}: {err}");
    }
    assert_eq!(server.metric("lantern_engine_steps_total"), before, "a refused request reached the engine");
    server.wait_idle(Duration::from_secs(10));
}

/// `/tokenize` and `/detokenize` (vLLM's shape): a prompt's ids round-trip, chat messages
/// get the template (the ids a chat completion of them counts as its prompt), bad ids are
/// refused naming the index.
#[test]
fn tokenize_and_detokenize() {
    let _s = serial();
    let server = Server::start(&[]);
    let r = server.post("/tokenize", &json!({"prompt": "Hello world", "return_token_strs": true}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["count"], v["tokens"].as_array().unwrap().len());
    assert_eq!(v["max_model_len"], CONTEXT);
    assert_eq!(v["token_strs"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect::<String>().trim(), "Hello world");
    let back = server.post("/detokenize", &json!({"model": MODEL_ID, "tokens": v["tokens"]})).json();
    assert_eq!(back["prompt"].as_str().unwrap().trim(), "Hello world");
    let messages = json!([{"role": "user", "content": "Say hi."}]);
    let t = server.post("/tokenize", &json!({"messages": messages})).json();
    let c = server.post("/v1/chat/completions", &json!({"model": MODEL_ID, "messages": messages, "max_tokens": 1})).json();
    assert_eq!(t["count"], c["usage"]["prompt_tokens"], "{t} {c}");
    let r = server.post("/detokenize", &json!({"tokens": [1, 99999999]}));
    assert_eq!((r.status, error_of(&r)["param"].clone()), (400, json!("tokens[1]")), "{}", r.text());
    let r = server.post("/tokenize", &json!({"model": "nope", "prompt": "x"}));
    assert_eq!(r.status, 404);
    server.wait_idle(Duration::from_secs(10));
}

/// `/metrics` also carries vLLM's names (what routers and gateways read), with the same
/// values as the `lantern_*` ones and the `model_name` label.
#[test]
fn metrics_carry_vllm_names() {
    let _s = serial();
    let server = Server::start(&[]);
    // Long enough to fill whole KV pages, which the second request finds in the prefix cache.
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(6);
    let body = json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 5, "temperature": 0});
    assert_eq!(server.post("/v1/completions", &body).status, 200);
    assert_eq!(server.post("/v1/completions", &body).status, 200);
    let text = server.wait_idle(Duration::from_secs(10));
    let l = format!("{{model_name=\"{MODEL_ID}\"}}");
    let v = |name: &str| metric(&text, &format!("vllm:{name}{l}"));
    assert_eq!(v("num_requests_running"), 0.0);
    assert_eq!(v("num_requests_waiting"), 0.0);
    assert_eq!(v("generation_tokens_total"), metric(&text, "lantern_completion_tokens_total"));
    assert_eq!(v("generation_tokens_total"), 10.0);
    assert_eq!(v("prompt_tokens_total"), metric(&text, "lantern_prompt_tokens_total"));
    assert_eq!(v("prefix_cache_hits_total"), metric(&text, "lantern_prefix_cache_hit_tokens_total"));
    assert!(v("prefix_cache_hits_total") > 0.0, "the second request reused the first one's prompt pages");
    let usage = v("kv_cache_usage_perc");
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    assert_eq!(metric(&text, &format!("vllm:time_to_first_token_seconds_count{l}")), 2.0);
    assert_eq!(metric(&text, &format!("vllm:request_success_total{{model_name=\"{MODEL_ID}\",finished_reason=\"length\"}}")), 2.0);
    assert!(text.contains("vllm:cache_config_info{") && text.contains("enable_prefix_caching=\"true\""), "{text}");
}

/// The port is bound before the model loads: meanwhile `/health` answers 503 `loading` and a
/// generation request 503 `model_loading` with `Retry-After` (a readiness probe and a router
/// wait instead of failing to connect); then 200.
#[test]
fn health_is_503_while_the_model_loads() {
    let _s = serial();
    let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("serve-loading-{}.log", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_lantern"))
        .env("LANTERN_OFFLINE", "1")
        .env_remove("LANTERN_API_KEY")
        .args(["serve", "--port", "0", "--context", "256", "--max-seqs", "4", "--model"])
        .arg(common::smollm2_gguf())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .expect("start lantern serve");
    let t0 = Instant::now();
    let addr = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(rest) = text.split("bound http://").nth(1) {
            break rest.split(';').next().unwrap().to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no bound line:\n{text}");
        std::thread::sleep(Duration::from_millis(5));
    };
    let first = http(&addr, "GET", "/health", &[], b"");
    let body = json!({"model": MODEL_ID, "prompt": "x", "max_tokens": 1});
    let early = http(&addr, "POST", "/v1/completions", &[("Content-Type", "application/json")], body.to_string().as_bytes());
    let mut ready = None;
    while ready.is_none() && t0.elapsed() < Duration::from_secs(120) {
        let h = http(&addr, "GET", "/health", &[], b"");
        if h.status == 200 {
            ready = Some(h);
        } else {
            assert_eq!((h.status, h.json()["status"].clone()), (503, json!("loading")), "{}", h.text());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!((first.status, first.json()["status"].clone()), (503, json!("loading")), "{}", first.text());
    assert_eq!(early.status, 503, "{}", early.text());
    assert_eq!(error_of(&early)["code"], "model_loading");
    assert!(early.header("retry-after").is_some(), "{:?}", early.headers);
    assert_eq!(ready.expect("never ready").json()["status"], "ok");
}

/// The official `anthropic` Python client (PyPI, installed by scripts/test.sh):
/// tests/clients/anthropic_client.py creates messages whole and streamed, forces a tool call
/// and answers it with a tool_result, stops at a stop sequence; the greedy answer equals
/// chat completions' for the same request.
#[test]
fn official_anthropic_python_client() {
    let _s = serial();
    let python = std::env::var("LANTERN_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", "import anthropic"]).output();
    assert!(
        probe.as_ref().is_ok_and(|o| o.status.success()),
        "{python} cannot import anthropic: run scripts/test.sh (it installs the client into target/pyenv) or set LANTERN_PYTHON"
    );
    let server = Server::start(&[]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/anthropic_client.py");
    let out = Command::new(&python).arg(script).arg(format!("http://{}", server.addr)).arg(MODEL_ID).output().expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the anthropic client failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let got: Value = serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("the script's answer");
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(got["text"], chat.json()["choices"][0]["message"]["content"], "/v1/messages and /v1/chat/completions differ");
    server.wait_idle(Duration::from_secs(10));
}

/// `/v1/messages` by hand: the event sequence of a stream, `x-api-key` next to bearer auth,
/// and bad input refused with a 4xx in Anthropic's shape naming the field, before anything
/// reaches the engine.
#[test]
fn messages_events_auth_and_bad_input() {
    let _s = serial();
    let server = Server::start_with_env(&[], &[("LANTERN_API_KEY", "sesame")]);
    let body = json!({"model": MODEL_ID, "max_tokens": 5, "temperature": 0, "stream": true,
        "system": "Answer briefly.", "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]});
    let send = |headers: &[(&str, &str)], body: &Value| {
        let mut h = vec![("Content-Type", "application/json")];
        h.extend_from_slice(headers);
        http(&server.addr, "POST", "/v1/messages", &h, body.to_string().as_bytes())
    };
    assert_eq!(send(&[], &body).status, 401);
    assert_eq!(send(&[("x-api-key", "wrong")], &body).status, 401);
    let r = send(&[("x-api-key", "sesame"), ("anthropic-version", "2023-06-01")], &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let names: Vec<String> = r.text().lines().filter_map(|l| l.strip_prefix("event: ").map(str::to_string)).collect();
    assert_eq!(names.first().map(String::as_str), Some("message_start"), "{names:?}");
    assert_eq!(&names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"], "{names:?}");
    assert!(names.iter().filter(|n| *n == "content_block_delta").count() >= 1, "{names:?}");
    let delta: Value = r
        .text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: ").and_then(|d| serde_json::from_str::<Value>(d).ok()))
        .find(|v| v["type"] == "message_delta")
        .unwrap();
    assert_eq!((delta["delta"]["stop_reason"].clone(), delta["usage"]["output_tokens"].clone()), (json!("max_tokens"), json!(5)));
    // The stream ends with its last token; a decode-ahead step behind it may still land.
    server.wait_idle(Duration::from_secs(10));
    let before = server.metric_with_key("lantern_engine_steps_total", "sesame");
    let user = json!([{"role": "user", "content": "x"}]);
    for (bad, field) in [
        (json!({"messages": user}), "max_tokens"),
        (json!({"max_tokens": 4}), "messages"),
        (json!({"max_tokens": 4, "messages": user, "temperature": 1.5}), "temperature"),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "messages[0].content[0].type",
        ),
        (json!({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}), "messages[0].role"),
        (json!({"max_tokens": 4, "messages": user, "tools": [{"name": "f"}]}), "tools[0].input_schema"),
        (json!({"max_tokens": 4, "messages": user, "tool_choice": {"type": "tool"}}), "tool_choice.name"),
        (json!({"max_tokens": 4, "messages": user, "thinking": {"type": "enabled", "budget_tokens": 1024}}), "thinking"),
        (json!({"max_tokens": 4, "messages": user, "stop_sequences": "x"}), "stop_sequences"),
    ] {
        let mut b = bad.clone();
        b["model"] = json!(MODEL_ID);
        let r = send(&[("x-api-key", "sesame")], &b);
        let v = r.json();
        assert_eq!(
            (r.status, v["type"].clone(), v["error"]["type"].clone()),
            (400, json!("error"), json!("invalid_request_error")),
            "{bad}: {v}"
        );
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(field), "{bad}: the error does not name {field}: {msg}");
    }
    let r = send(&[("x-api-key", "sesame")], &json!({"model": "nope", "max_tokens": 4, "messages": user}));
    assert_eq!((r.status, r.json()["error"]["type"].clone()), (404, json!("not_found_error")));
    assert_eq!(server.metric_with_key("lantern_engine_steps_total", "sesame"), before, "a refused request reached the engine");
}

/// `/v1/responses` refuses bad input with a 4xx naming the Responses field (OpenAI's error
/// shape), before anything reaches the engine; an unknown `previous_response_id` is 404.
#[test]
fn responses_refuse_bad_input() {
    let _s = serial();
    let server = Server::start(&[]);
    let before = server.metric("lantern_engine_steps_total");
    for (bad, status, param) in [
        (json!({}), 400, "input"),
        (json!({"input": 3}), 400, "input"),
        (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}), 400, "input[0].content[0].type"),
        (json!({"input": [{"type": "web_search_call"}]}), 400, "input[0].type"),
        (json!({"input": "x", "tools": [{"type": "web_search"}]}), 400, "tools[0].type"),
        (json!({"input": "x", "temperature": 7}), 400, "temperature"),
        (json!({"input": "x", "text": {"format": {"type": "yaml"}}}), 400, "text.format.type"),
        (json!({"input": "x".repeat(2000)}), 400, "input"),
        (json!({"input": "x", "previous_response_id": "resp_nope"}), 404, "previous_response_id"),
    ] {
        let mut b = bad.clone();
        b["model"] = json!(MODEL_ID);
        let r = server.post("/v1/responses", &b);
        assert_eq!((r.status, error_of(&r)["param"].clone()), (status, json!(param)), "{bad}: {}", r.text());
    }
    assert_eq!(server.metric("lantern_engine_steps_total"), before, "a refused request reached the engine");
}

/// `/v1/embeddings` and Ollama's `/api/embed` and `/api/embeddings`: one unit vector per
/// input (the model's hidden size), text and its token ids alike, mean and last pooling
/// distinct, the same vector on every route and while a generation runs beside it; bad input
/// is refused naming the field, before anything reaches the engine.
#[test]
fn embeddings_on_every_route_and_bad_input() {
    let _s = serial();
    let server = Server::start(&[]);
    let floats = |v: &Value| -> Vec<f32> { v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect() };
    let r = server.post("/v1/embeddings", &json!({"model": MODEL_ID, "input": ["Hello world", "Goodbye"]}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!((v["object"].clone(), v["pooling"].clone()), (json!("list"), json!("mean")));
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    let a = floats(&data[0]["embedding"]);
    assert_eq!(a.len(), 576, "SmolLM2-135M's hidden size");
    assert!((a.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-4);
    let ids = server.post("/tokenize", &json!({"prompt": "Hello world"})).json()["tokens"].clone();
    let by_ids = server.post("/v1/embeddings", &json!({"model": MODEL_ID, "input": ids}));
    assert_eq!(floats(&by_ids.json()["data"][0]["embedding"]), a, "token ids embed as their text");
    let n =
        ids.as_array().unwrap().len() + server.post("/tokenize", &json!({"prompt": "Goodbye"})).json()["count"].as_u64().unwrap() as usize;
    assert_eq!(v["usage"]["prompt_tokens"], n);
    let last = server.post("/v1/embeddings", &json!({"model": MODEL_ID, "input": "Hello world", "pooling": "last"})).json();
    assert_eq!(last["pooling"], "last");
    assert_ne!(floats(&last["data"][0]["embedding"]), a);
    // base64: the same floats, little-endian.
    let b = server.post("/v1/embeddings", &json!({"model": MODEL_ID, "input": "Hello world", "encoding_format": "base64"})).json();
    let bytes = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let decoded: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(decoded, a);
    // Ollama's routes give the same vector.
    let o = server.post("/api/embed", &json!({"model": MODEL_ID, "input": "Hello world"}));
    assert_eq!(o.status, 200, "{}", o.text());
    assert_eq!(floats(&o.json()["embeddings"][0]), a);
    let legacy = server.post("/api/embeddings", &json!({"model": MODEL_ID, "prompt": "Hello world"})).json();
    assert_eq!(floats(&legacy["embedding"]), a);
    // Beside a running generation: both finish, the vector unchanged.
    let addr = server.addr.clone();
    let gen = std::thread::spawn(move || {
        let body = json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0});
        http(&addr, "POST", "/v1/completions", &[("Content-Type", "application/json")], body.to_string().as_bytes()).status
    });
    let during = server.post("/v1/embeddings", &json!({"model": MODEL_ID, "input": "Hello world"}));
    assert_eq!(floats(&during.json()["data"][0]["embedding"]), a);
    assert_eq!(gen.join().unwrap(), 200);
    // Bad input: 400 naming the field (404 for a model not served), nothing run.
    let long = "word ".repeat(CONTEXT * 2);
    for (body, status, param) in [
        (json!({"model": MODEL_ID}), 400, "input"),
        (json!({"input": "x"}), 400, "model"),
        (json!({"model": "nope", "input": "x"}), 404, "model"),
        (json!({"model": MODEL_ID, "input": ""}), 400, "input"),
        (json!({"model": MODEL_ID, "input": []}), 400, "input"),
        (json!({"model": MODEL_ID, "input": ["ok", 7]}), 400, "input[1]"),
        (json!({"model": MODEL_ID, "input": [1, 99999999]}), 400, "input[1]"),
        (json!({"model": MODEL_ID, "input": "x", "encoding_format": "int8"}), 400, "encoding_format"),
        (json!({"model": MODEL_ID, "input": "x", "dimensions": 64}), 400, "dimensions"),
        (json!({"model": MODEL_ID, "input": "x", "pooling": "max"}), 400, "pooling"),
        (json!({"model": MODEL_ID, "input": long}), 400, "input[0]"),
    ] {
        let r = server.post("/v1/embeddings", &body);
        assert_eq!((r.status, error_of(&r)["param"].clone()), (status, json!(param)), "{body}: {}", r.text());
    }
    let r = server.post("/api/embed", &json!({"model": MODEL_ID, "input": long, "truncate": false}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.json()["error"].as_str().unwrap().contains("context"), "{}", r.text());
    let r = server.post("/api/embed", &json!({"model": MODEL_ID, "input": long}));
    assert_eq!(r.status, 200, "Ollama truncates by default: {}", r.text());
    let r = server.post("/api/embed", &json!({"input": "x"}));
    assert_eq!(r.status, 400, "{}", r.text());
    server.wait_idle(Duration::from_secs(10));
}

/// SGLang's model gateway (`smg`, PyPI, a Rust binary; scripts/test.sh installs it into
/// target/pyenv), launched against replicas on loopback ports, killed on drop.
struct Gateway {
    child: Child,
    addr: String,
    log: PathBuf,
}

/// A greedy chat completion sent to `addr` (a replica or the gateway).
fn chat_at(addr: &str, messages: Value, max_tokens: usize, stream: bool) -> Response {
    let body = json!({"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream});
    http(addr, "POST", "/v1/chat/completions", &[("Content-Type", "application/json")], body.to_string().as_bytes())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl Gateway {
    fn start(policy: &str, replicas: &[&Server]) -> Gateway {
        let python = PathBuf::from(std::env::var("LANTERN_PYTHON").unwrap_or_else(|_| "python3".into()));
        let smg = python.parent().map(|d| d.join("smg")).filter(|p| p.exists()).unwrap_or_else(|| {
            panic!("no smg next to {}: run scripts/test.sh (it installs smg into target/pyenv) or set LANTERN_PYTHON", python.display())
        });
        let (port, prom) = (free_port(), free_port());
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("smg-{}-{port}.log", std::process::id()));
        let mut cmd = Command::new(smg);
        cmd.args(["launch", "--host", "127.0.0.1", "--port", &port.to_string(), "--policy", policy])
            .args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &prom.to_string(), "--log-level", "warn"])
            .arg("--worker-urls")
            .args(replicas.iter().map(|r| format!("http://{}", r.addr)))
            .stdin(Stdio::null())
            .stdout(Stdio::from(std::fs::File::create(&log).expect("gateway log")))
            .stderr(Stdio::null());
        let gw = Gateway { child: cmd.spawn().expect("start smg"), addr: format!("127.0.0.1:{port}"), log };
        // Ready when every replica is registered, healthy and recognised as vLLM-compatible (it
        // answers /version), so the gateway reads its load from the vLLM-named metrics.
        let t0 = Instant::now();
        loop {
            let workers = TcpStream::connect(&gw.addr).ok().map(|_| http(&gw.addr, "GET", "/workers", &[], b""));
            if let Some(w) = workers.filter(|w| w.status == 200) {
                let w = w.json();
                let ready = w["workers"].as_array().is_some_and(|ws| {
                    ws.len() == replicas.len() && ws.iter().all(|x| x["is_healthy"] == json!(true) && x["runtime_type"] == json!("vllm"))
                });
                if ready {
                    return gw;
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "smg did not register the replicas; its log:\n{}", gw.log_text());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn chat(&self, system: &str, user: &str, max_tokens: usize, stream: bool) -> Response {
        chat_at(&self.addr, json!([{"role": "system", "content": system}, {"role": "user", "content": user}]), max_tokens, stream)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Four system prompts of about a hundred tokens, each starting with its own words (so no two
/// share a KV page), three questions each, sent one after another through the gateway: the
/// prompt tokens all replicas found in their prefix caches, and the requests each replica finished.
fn shared_prefix_workload(gw: &Gateway, replicas: &[&Server], tag: &str) -> (f64, Vec<f64>) {
    let hits = |s: &Server| s.metric(&format!("vllm:prefix_cache_hits_total{{model_name=\"{MODEL_ID}\"}}"));
    // Absent until a request of that outcome finished.
    let done = |s: &Server| {
        let text = s.get("/metrics").text();
        text.lines().find_map(|l| l.strip_prefix("lantern_requests_total{outcome=\"length\"} ")).map_or(0.0, |v| v.trim().parse().unwrap())
    };
    let before: Vec<(f64, f64)> = replicas.iter().map(|s| (hits(s), done(s))).collect();
    let topics = ["lighthouses", "volcanoes", "glaciers", "orchards"];
    for (g, topic) in topics.iter().enumerate() {
        let system = format!(
            "{tag} {topic} desk {g}. You are a patient assistant who answers questions about {topic}. Keep every answer \
             short, use plain words, mention one fact about {topic} that a child would enjoy, avoid lists and headings, \
             never invent numbers, and say so when you are not sure. The reader is curious but busy."
        );
        for q in 0..3 {
            let r = gw.chat(&system, &format!("Question {q}: why?"), 2, false);
            assert_eq!(r.status, 200, "through the gateway: {}\n{}", r.text(), gw.log_text());
            assert_eq!(r.json()["choices"][0]["finish_reason"], "length", "{}", r.text());
        }
    }
    let hit_total = replicas.iter().zip(&before).map(|(s, b)| hits(s) - b.0).sum();
    (hit_total, replicas.iter().zip(&before).map(|(s, b)| done(s) - b.1).collect())
}

/// Replicas behind an existing router (SGLang's model gateway from PyPI), loopback only: it
/// recognises them by /version and reads their load from the vLLM-named metrics; round robin
/// spreads requests over both; cache-aware routing finds more prompt tokens in the replicas'
/// prefix caches than round robin on a workload with shared prefixes; a replica killed while
/// requests run on it loses none (the gateway retries them on the other); and a replica drained
/// with SIGTERM ends every stream the gateway passes through with a final chunk and `[DONE]`.
#[test]
fn replicas_behind_sglang_model_gateway() {
    let _s = serial();
    let mut a = Server::start(&[]);
    let mut b = Server::start(&[]);

    let gw = Gateway::start("round_robin", &[&a, &b]);
    let (rr_hits, spread) = shared_prefix_workload(&gw, &[&a, &b], "Round robin");
    assert_eq!(spread.iter().sum::<f64>(), 12.0, "every request finished on a replica: {spread:?}");
    assert!(spread.iter().all(|&n| n >= 4.0), "round robin spreads requests over both replicas: {spread:?}");
    drop(gw);

    let gw = Gateway::start("cache_aware", &[&a, &b]);
    let (ca_hits, spread) = shared_prefix_workload(&gw, &[&a, &b], "Cache aware");
    assert_eq!(spread.iter().sum::<f64>(), 12.0, "{spread:?}");
    eprintln!("prefix-cache hits over 12 requests: round robin {rr_hits} tokens, cache-aware {ca_hits}");
    assert!(ca_hits > rr_hits, "cache-aware routing finds more cached prompt tokens ({ca_hits}) than round robin ({rr_hits})");

    // Eight requests at once, round robin so that half go to replica b, which is killed while it
    // runs some of them.
    drop(gw);
    let gw = Gateway::start("round_robin", &[&a, &b]);
    let requests: Vec<_> = (0..8)
        .map(|i| {
            let addr = gw.addr.clone();
            std::thread::spawn(move || chat_at(&addr, json!([{"role": "user", "content": format!("Count to {i}.")}]), 32, false))
        })
        .collect();
    let t0 = Instant::now();
    while b.metric("lantern_requests_running") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "no request reached replica b");
        std::thread::sleep(Duration::from_millis(5));
    }
    b.child.kill().expect("kill replica b");
    let _ = b.child.wait();
    for (i, r) in requests.into_iter().map(|t| t.join().unwrap()).enumerate() {
        assert_eq!(r.status, 200, "request {i} was lost with replica b: {}\n{}", r.text(), gw.log_text());
        let finish = r.json()["choices"][0]["finish_reason"].clone();
        assert!(finish == "length" || finish == "stop", "request {i}: {}", r.text());
    }

    // Two streams through the gateway on replica a, which is then drained with SIGTERM: both
    // finish (they fit in its shutdown deadline) and end with their final chunk and [DONE].
    let streams: Vec<_> = (0..2)
        .map(|i| {
            let addr = gw.addr.clone();
            std::thread::spawn(move || chat_at(&addr, json!([{"role": "user", "content": format!("Name {i} colours.")}]), 16, true))
        })
        .collect();
    let t0 = Instant::now();
    while a.metric("lantern_requests_running") < 2.0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "the streams never ran on replica a");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(Command::new("kill").args(["-TERM", &a.child.id().to_string()]).status().unwrap().success());
    for (i, r) in streams.into_iter().map(|t| t.join().unwrap()).enumerate() {
        assert_eq!(r.status, 200, "stream {i}: {}", r.text());
        let events = r.events();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "stream {i} has no final event: {events:?}");
        let finish = events
            .iter()
            .rev()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find_map(|v| v["choices"][0]["finish_reason"].as_str().map(String::from));
        assert!(matches!(finish.as_deref(), Some("length" | "stop")), "stream {i} did not finish: {events:?}");
    }
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = a.child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "replica a did not exit after draining");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "replica a's exit status {status}");
}

/// The `lantern` argument list a deployment file gives after `key: [`, a JSON-compatible flow
/// sequence that may span lines.
fn deploy_args(file: &str, key: &str) -> Vec<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let start = text.find(&format!("{key}: [\"serve\"")).unwrap_or_else(|| panic!("{file} has no `{key}: [\"serve\", ...]`"));
    let list = &text[start + key.len() + 2..];
    let list = &list[..=list.find(']').expect("a closing ]")];
    serde_json::from_str(&list.lines().map(str::trim).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|e| panic!("{file}: {key}: {e}: {list}"))
}

/// deploy/kubernetes.yaml and deploy/compose.yaml start replicas with flags `lantern serve`
/// accepts, on the port their probes, scrape annotations and the gateway use, with a catalogue
/// model, and /health and /metrics answer what the probes and Prometheus expect.
#[test]
fn deployment_files_name_real_flags_ports_and_paths() {
    let _s = serial();
    let k8s = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes.yaml")).unwrap();
    let catalogue = Command::new(env!("CARGO_BIN_EXE_lantern")).arg("models").env("LANTERN_OFFLINE", "1").output().unwrap();
    let catalogue = String::from_utf8_lossy(&catalogue.stdout).into_owned();
    for (file, key) in [("kubernetes.yaml", "args"), ("compose.yaml", "command")] {
        let args = deploy_args(file, key);
        let value =
            |flag: &str| args.iter().position(|a| a == flag).map(|i| args[i + 1].clone()).unwrap_or_else(|| panic!("{file}: no {flag}"));
        assert_eq!(value("--host"), "0.0.0.0", "{file}: a replica must listen beyond its container's loopback");
        assert_eq!(value("--port"), "8080", "{file}: the port the probes, annotations and gateway use");
        let model = value("--model");
        assert!(model.starts_with("${MODEL:-") || catalogue.contains(&model), "{file}: {model} is not in `lantern models`:\n{catalogue}");
        // The rest of the flags, on the test model and a free loopback port.
        let mut rest: Vec<&str> = Vec::new();
        let mut it = args[1..].iter();
        while let Some(a) = it.next() {
            if ["--host", "--port", "--model"].contains(&a.as_str()) {
                it.next();
            } else {
                rest.push(a);
            }
        }
        let server = Server::start(&rest);
        let health = server.get("/health");
        assert_eq!(health.status, 200, "{file}: the readiness probe's /health: {}", health.text());
        let name = value("--model-name");
        let models = server.get("/v1/models").json();
        assert_eq!(models["data"][0]["id"], json!(name), "{file}: the gateway and clients ask for --model-name");
        let metrics = server.get("/metrics").text();
        assert!(
            metrics.contains("vllm:num_requests_running") && metrics.contains("vllm:kv_cache_usage_perc"),
            "{file}: /metrics: {metrics}"
        );
        drop(server);
    }
    for needle in [
        "path: /health",
        "prometheus.io/path: \"/metrics\"",
        "prometheus.io/port: \"8080\"",
        "containerPort: 8080",
        "--service-discovery-port\", \"8080\"",
    ] {
        assert!(k8s.contains(needle), "deploy/kubernetes.yaml lacks {needle}");
    }
    let grace: u64 =
        k8s.lines().find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds: ")).expect("a grace period").parse().unwrap();
    let drain: u64 = deploy_args("kubernetes.yaml", "args")
        .windows(2)
        .find(|w| w[0] == "--shutdown-timeout")
        .map(|w| w[1].parse().unwrap())
        .expect("--shutdown-timeout");
    assert!(grace > drain + 5, "the pod's grace period ({grace} s) must cover preStop's 5 s and the drain's {drain} s");
}
