// lantern-web: Lantern (a WebGPU LLM runtime in Rust) for web pages, with an OpenAI-style API.
//
//   import { createEngine } from 'lantern-web';
//   const engine = await createEngine({ model: 'smollm2-135m', onProgress: console.log });
//   const stream = await engine.chat.completions.create({ messages, stream: true });
//   for await (const chunk of stream) out.textContent += chunk.choices[0]?.delta?.content ?? '';
//
// The engine runs in a Web Worker this module creates (worker.js, which loads lantern.js and
// lantern_bg.wasm, all next to this file: bundlers that follow `new URL(..., import.meta.url)`
// such as Vite copy them; with esbuild, copy them next to the bundle or pass `assetBase`).

const CACHE_NAME = 'lantern-models-v1';

/** An error with a `code`: no_adapter, download_failed, bad_model, out_of_memory,
 * invalid_options, invalid_request, aborted, not_loaded, ... and for requests the OpenAI
 * error's `status`, `type` and `param`. */
export class LanternError extends Error {
  constructor(message, code, extra = {}) {
    super(message);
    this.name = 'LanternError';
    this.code = code;
    Object.assign(this, extra);
  }

  /** From an OpenAI error answer (`status`, JSON `body`). */
  static fromApi(status, body) {
    let e = {};
    try { e = JSON.parse(body).error || {}; } catch { e = { message: String(body) }; }
    return new LanternError(e.message || `request failed (${status})`, e.code || e.type || 'invalid_request', { status, type: e.type, param: e.param ?? null });
  }
}

const aborted = () => new LanternError('the request was aborted', 'aborted');

/** A pull queue of values (a stream's chunks) that can end or fail. */
class Channel {
  constructor() { this.items = []; this.waiters = []; this.end = false; this.error = null; }
  push(v) { const w = this.waiters.shift(); if (w) w.resolve({ value: v, done: false }); else this.items.push(v); }
  close() { this.end = true; for (const w of this.waiters.splice(0)) w.resolve({ value: undefined, done: true }); }
  fail(e) { if (this.end || this.error) return; this.error = e; for (const w of this.waiters.splice(0)) w.reject(e); }
  next() {
    if (this.items.length) return Promise.resolve({ value: this.items.shift(), done: false });
    if (this.error) return Promise.reject(this.error);
    if (this.end) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve, reject) => this.waiters.push({ resolve, reject }));
  }
}

function defaultBase(path) {
  const here = typeof document !== 'undefined' ? document.baseURI : self.location.href;
  return new URL(path, here).href;
}

class Engine {
  constructor(worker) {
    this.worker = worker;
    this.rid = 0;
    this.calls = new Map();   // rid -> { resolve, reject, progress }
    this.listeners = new Map(); // request id -> handler of its event messages
    this.early = new Map();   // request id -> event messages that came before its listener
    this.modelId = null;
    this.dead = null;
    worker.onmessage = ({ data }) => this.receive(data);
    worker.onerror = (e) => this.die(new LanternError(`the engine's worker failed: ${e.message || e}`, 'worker_failed'));
    this.chat = { completions: { create: (p) => this.create('chat', p) } };
    this.completions = { create: (p) => this.create('completions', p) };
    this.models = {
      list: () => this.listModels(),
      cached: () => cachedModels(),
      delete: (nameOrUrl) => this.deleteModel(nameOrUrl),
    };
    this.fetch = (input, init) => this.handleFetch(input, init);
  }

  receive(m) {
    if (m.fatal) return this.die(new LanternError(m.fatal.message, m.fatal.code));
    if (m.events !== undefined) {
      const l = this.listeners.get(m.events);
      if (l) l(m); else this.early.set(m.events, [...(this.early.get(m.events) || []), m]);
      return;
    }
    const c = this.calls.get(m.rid);
    if (!c) return;
    if (m.progress) { c.progress?.(m.progress); return; }
    this.calls.delete(m.rid);
    if (m.error) c.reject(new LanternError(m.error.message, m.error.code)); else c.resolve(m.value);
  }

  die(e) {
    this.dead = e;
    for (const c of this.calls.values()) c.reject(e);
    this.calls.clear();
    for (const l of this.listeners.values()) l({ error: { status: 503, body: JSON.stringify({ error: { message: e.message, code: e.code } }) }, done: true });
  }

  call(op, args = {}, progress) {
    if (this.dead) return Promise.reject(this.dead);
    const rid = ++this.rid;
    return new Promise((resolve, reject) => {
      this.calls.set(rid, { resolve, reject, progress });
      this.worker.postMessage({ rid, op, ...args });
    });
  }

  listen(id, handler) {
    this.listeners.set(id, handler);
    for (const m of this.early.get(id) || []) handler(m);
    this.early.delete(id);
  }

  /** Submit an OpenAI body: the request id, or a thrown LanternError (the API's refusal). */
  async submit(endpoint, body, signal) {
    if (signal?.aborted) throw aborted();
    const r = await this.call('submit', { endpoint, body: typeof body === 'string' ? body : JSON.stringify(body) });
    if (r.status) throw LanternError.fromApi(r.status, r.body);
    return r;
  }

  /** `{ chunks, done, response, error }` messages of request `id` as a channel of parsed
   * chunks (or the one response), aborted by `signal`. */
  channel(id, signal) {
    const ch = new Channel();
    const onAbort = () => { this.cancel(id); ch.fail(aborted()); };
    signal?.addEventListener('abort', onAbort, { once: true });
    this.listen(id, (m) => {
      for (const c of m.chunks || []) ch.push(JSON.parse(c));
      if (m.response) ch.push(JSON.parse(m.response));
      if (m.error) ch.fail(LanternError.fromApi(m.error.status, m.error.body));
      if (m.done) {
        this.listeners.delete(id);
        signal?.removeEventListener('abort', onAbort);
        ch.close();
      }
    });
    return ch;
  }

  cancel(id) {
    this.listeners.delete(id);
    this.call('cancel', { id }).catch(() => {});
  }

  async create(endpoint, params = {}) {
    // `model` may be left out: the loaded model answers.
    const { signal, ...rest } = params;
    const body = { model: this.modelId, ...rest };
    const { id, stream } = await this.submit(endpoint, body, signal);
    const ch = this.channel(id, signal);
    if (!stream) {
      const r = await ch.next();
      if (r.done) throw aborted();
      return r.value;
    }
    const engine = this;
    let finished = false;
    return {
      /** Stop generating: the iterator ends, the sequence is freed. */
      abort() { if (!finished) { finished = true; engine.cancel(id); ch.close(); } },
      async next() { const r = await ch.next(); if (r.done) finished = true; return r; },
      async return() { this.abort(); return { value: undefined, done: true }; },
      [Symbol.asyncIterator]() { return this; },
    };
  }

  /** Token ids of `text` (no special tokens added). */
  tokenize(text) { return this.call('tokenize', { text }); }
  /** The text of token ids. */
  detokenize(ids) { return this.call('detokenize', { ids: Array.from(ids) }); }
  /** The memory plan: weights, KV cache, workspace, context, sequences, the adapter. */
  plan() { return this.call('plan'); }
  /** Free the GPU memory and end the worker. */
  async unload() {
    try { await this.call('unload'); } finally {
      this.worker.terminate();
      this.die(new LanternError('the engine was unloaded', 'not_loaded'));
    }
  }

  async listModels() {
    const cached = new Set(await cachedModels());
    const list = await this.call('catalogue');
    return list.map((m) => ({ ...m, url: new URL(m.file, this.modelBase).href, cached: cached.has(new URL(m.file, this.modelBase).href) }));
  }

  async deleteModel(nameOrUrl) {
    if (typeof caches === 'undefined') return false;
    const entry = (await this.call('catalogue')).find((m) => m.name === nameOrUrl);
    const url = entry ? new URL(entry.file, this.modelBase).href : new URL(nameOrUrl, defaultBase('.')).href;
    return (await caches.open(CACHE_NAME)).delete(url);
  }

  /** A `fetch` answering /v1/chat/completions, /v1/completions and /v1/models in the page
   * (for the `openai` client: `new OpenAI({ baseURL: 'http://lantern.local/v1', apiKey:
   * 'none', fetch: engine.fetch, dangerouslyAllowBrowser: true })`). */
  async handleFetch(input, init) {
    const req = input instanceof Request && !init ? input : new Request(input, init);
    const path = new URL(req.url).pathname.replace(/\/+$/, '');
    const json = (status, v) => new Response(typeof v === 'string' ? v : JSON.stringify(v), { status, headers: { 'content-type': 'application/json' } });
    const notFound = () => json(404, { error: { message: `no route ${req.method} ${path}`, type: 'invalid_request_error', code: 'not_found' } });
    if (path.endsWith('/models') && req.method === 'GET') {
      return json(200, { object: 'list', data: [{ id: this.modelId, object: 'model', created: this.created, owned_by: 'lantern' }] });
    }
    const endpoint = path.endsWith('/chat/completions') ? 'chat' : path.endsWith('/completions') ? 'completions' : null;
    if (!endpoint || req.method !== 'POST') return notFound();
    let r;
    try {
      r = await this.call('submit', { endpoint, body: await req.text() });
    } catch (e) {
      return json(e.code === 'not_loaded' ? 503 : 500, { error: { message: e.message, type: 'server_error', code: e.code } });
    }
    if (r.status) return json(r.status, r.body);
    const signal = req.signal;
    if (!r.stream) {
      const ch = this.channel(r.id, signal);
      try {
        const v = await ch.next();
        return json(200, v.value);
      } catch (e) {
        if (e.code === 'aborted') throw new DOMException('The operation was aborted.', 'AbortError');
        return json(e.status || 500, { error: { message: e.message, type: e.type || 'server_error', code: e.code } });
      }
    }
    const id = r.id;
    const enc = new TextEncoder();
    const engine = this;
    const body = new ReadableStream({
      start(controller) {
        const onAbort = () => { engine.cancel(id); controller.error(new DOMException('The operation was aborted.', 'AbortError')); };
        signal?.addEventListener('abort', onAbort, { once: true });
        engine.listen(id, (m) => {
          for (const c of m.chunks || []) controller.enqueue(enc.encode(`data: ${c}\n\n`));
          if (m.error) controller.enqueue(enc.encode(`data: ${m.error.body}\n\n`));
          if (m.done) {
            engine.listeners.delete(id);
            signal?.removeEventListener('abort', onAbort);
            controller.enqueue(enc.encode('data: [DONE]\n\n'));
            controller.close();
          }
        });
      },
      cancel() { engine.cancel(id); },
    });
    return new Response(body, { status: 200, headers: { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' } });
  }
}

/** URLs of the models kept in Cache Storage. */
export async function cachedModels() {
  if (typeof caches === 'undefined') return [];
  const keys = await (await caches.open(CACHE_NAME)).keys();
  return keys.map((r) => r.url);
}

function workerUrl(assetBase) {
  return assetBase ? new URL('worker.js', new URL(assetBase, defaultBase('.'))) : new URL('./worker.js', import.meta.url);
}

/** A call into a short-lived worker with no model (the catalogue, the adapter). */
async function withoutModel(assetBase, op) {
  const engine = new Engine(new Worker(workerUrl(assetBase), { type: 'module' }));
  try { return await engine.call(op); } finally { engine.worker.terminate(); }
}

/** The catalogue (the models `lantern models` lists), before any model is loaded: each with
 * its URL under `modelBase` (default `models/` beside the page) and whether Cache Storage
 * holds it. */
export async function listModels(options = {}) {
  const base = new URL(options.modelBase ?? 'models/', defaultBase('.')).href;
  const [list, cached] = await Promise.all([withoutModel(options.assetBase, 'catalogue'), cachedModels()]);
  const have = new Set(cached);
  return list.map((m) => { const url = new URL(m.file, base).href; return { ...m, url, cached: have.has(url) }; });
}

/** The browser's WebGPU adapter (name, backend, features, limits); rejects with a
 * LanternError saying why when there is none. */
export async function adapterInfo(options = {}) {
  return withoutModel(options.assetBase, 'adapter');
}

/** Load a model in a Web Worker of its own and resolve to its engine. `model`: a catalogue
 * name (fetched from `modelBase`, default `models/` beside the page), a URL, a `File`, a
 * `Blob` or a `Uint8Array`. Failures reject with a LanternError (`no_adapter`,
 * `download_failed`, `bad_model`, `out_of_memory`, `invalid_options`). */
export async function createEngine(options = {}) {
  const { model, onProgress, draft, kvDtype, contextLength, memoryBudget, maxSeqs, weights, modelBase, assetBase } = options;
  if (model === undefined || model === null) throw new LanternError('createEngine needs a `model` (a catalogue name, a URL or a File)', 'invalid_options');
  const engine = new Engine(new Worker(workerUrl(assetBase), { type: 'module' }));
  engine.modelBase = new URL(modelBase ?? 'models/', defaultBase('.')).href;
  const loadOptions = { context: contextLength, kvDtype, memoryBudget, maxSeqs, weights };
  for (const k of Object.keys(loadOptions)) if (loadOptions[k] === undefined) delete loadOptions[k];
  try {
    const r = await engine.call('load', { model, draft, modelBase: engine.modelBase, pageBase: defaultBase('.'), options: loadOptions }, onProgress);
    engine.modelId = r.modelId;
    engine.source = r.source;
    engine.created = Math.floor(Date.now() / 1000);
    return engine;
  } catch (e) {
    engine.worker.terminate();
    throw e;
  }
}
