// The demo: a chat page built on the lantern-web package as any app would build it (npm
// install of the packed tarball, bundled with esbuild by web/build.mjs; marked renders the
// answers' markdown and DOMPurify cleans it). It names the WebGPU adapter, offers the
// catalogue with each model's size and cached state (or a GGUF file from disk), shows the
// download and upload with a progress bar and the memory plan once loaded, streams answers
// with TTFT and tokens/s, and stops a generation. Every failure becomes a sentence in the
// error box. The body's data attributes (state, source, loadMs, outputText, timings, error)
// are for the end-to-end test (web/e2e.mjs) and benchmarks that drive the page.
import { createEngine, listModels, adapterInfo } from 'lantern-web';
import { marked } from 'marked';
import DOMPurify from 'dompurify';

const $ = (id) => document.getElementById(id);
const mb = (b) => `${(b / 1e6).toFixed(1)} MB`;
const params = new URLSearchParams(location.search);

let engine = null;
let loadStarted = 0;
// The conversation so far in chat mode: [{ role, content }].
let history = [];
// The stream in progress (its abort ends it).
let current = null;

function showError(text) {
  $('error').textContent = text;
  $('error').hidden = false;
  document.body.dataset.error = text;
}

function clearError() {
  $('error').hidden = true;
  delete document.body.dataset.error;
}

function busy(loading) {
  $('load-url').disabled = loading;
  $('model-file').disabled = loading;
  $('forget').disabled = loading;
}

// A message in the transcript: the user's text as typed, the model's as markdown (chat) or
// as plain text (a continuation).
function addMessage(role, text, markdown) {
  const div = document.createElement('div');
  div.className = `msg ${role}${markdown || role === 'user' ? '' : ' text'}`;
  const who = document.createElement('span');
  who.className = 'who';
  who.textContent = role === 'user' ? 'You' : 'Assistant';
  const body = document.createElement('div');
  div.append(who, body);
  $('messages').append(div);
  const set = (t) => {
    if (markdown) body.innerHTML = DOMPurify.sanitize(marked.parse(t));
    else body.textContent = t;
  };
  set(text);
  return set;
}

function showPlan(plan) {
  const m = plan.memory;
  const a = plan.adapter;
  const weights = Object.entries(m.weights).map(([k, d]) => `${k} ${mb(d.bytes + d.scale_bytes)}`).join(', ');
  const rows = [
    ['model', `${plan.model} (${plan.config.num_layers} layers, d_model ${plan.config.hidden_size}, vocab ${plan.config.vocab_size})`],
    ['from', plan.source === 'cache' ? 'the browser cache (no download)' : plan.source],
    ['adapter', `${a.name || '(unnamed)'} · ${a.backend} · shader-f16 ${a.capabilities.shader_f16 ? 'yes' : 'no'} · subgroups ${a.capabilities.subgroups ? 'yes' : 'no'}`],
    ['weights', `${mb(plan.weightBytes)} (${weights})`],
    ['KV cache', `${mb(plan.kvCacheBytes)} · ${m.kv_dtype} · ${m.kv_pages} pages of ${m.kv_page_size} tokens · ${plan.maxSeqs} sequences` +
      (m.kv_window_ring ? ` · sliding layers keep a ${m.kv_window_ring.pages * m.kv_window_ring.page_size}-token ring (${mb(m.kv_ring_bytes)})` : '')],
    ['workspace', mb(m.workspace)],
    ['context', `${plan.context} tokens`],
    ['budget', m.budget ? `${mb(m.budget)} (${m.budget_source})` : 'browsers do not report GPU memory: the KV cache holds what was asked for'],
    ['loaded in', `${((performance.now() - loadStarted) / 1000).toFixed(1)} s`],
  ];
  const t = $('plan');
  t.replaceChildren(...rows.map(([k, v]) => {
    const tr = document.createElement('tr');
    for (const text of [k, v]) {
      const td = document.createElement('td');
      td.textContent = text;
      tr.append(td);
    }
    return tr;
  }));
  t.hidden = false;
}

// The catalogue, each model offered when this site serves its file under models/ (a HEAD
// request says), with its size and whether the browser has it cached; the others named
// with the command that fetches them.
async function showCatalogue() {
  const select = $('model-url');
  const keep = [...select.options].filter((o) => o.dataset.query);
  const missing = [];
  const options = [];
  for (const m of await listModels()) {
    const label = `${m.name} (${m.family}, ${m.params}, ${m.format}, ${mb(m.bytes)}${m.cached ? ', cached' : ''})`;
    let here = m.cached;
    if (!here) {
      try { here = (await fetch(m.url, { method: 'HEAD' })).ok; } catch { here = false; }
    }
    if (here) options.push(new Option(label, m.url, m.default && !keep.length, m.default && !keep.length));
    else missing.push(m.name);
  }
  select.replaceChildren(...keep, ...options);
  $('catalogue-note').textContent = missing.length
    ? `Not on this site: ${missing.join(', ')} (\`lantern fetch NAME\` puts a model where the demo server serves it).`
    : '';
}

function onProgress(p) {
  $('progress').hidden = false;
  $('progress-bar').value = p.total > 0 ? p.done / p.total : 0;
  const what = { download: 'Downloading', cache: 'Reading from the browser cache', read: 'Reading the file', upload: 'Uploading to the GPU' }[p.phase] || p.phase;
  const amount = p.phase === 'upload' ? `layer ${p.done} of ${p.total}` : `${mb(p.done)} of ${mb(p.total)}`;
  $('progress-label').textContent = `${what}: ${amount}`;
}

async function load(model) {
  clearError();
  $('generate').disabled = true;
  busy(true);
  loadStarted = performance.now();
  document.body.dataset.state = 'loading';
  const old = engine;
  engine = null;
  if (old) await old.unload().catch(() => {});
  try {
    engine = await createEngine({ model, onProgress, contextLength: 4096, maxSeqs: 1 });
    const plan = await engine.plan();
    $('progress-label').textContent = 'Ready.';
    $('progress-bar').value = 1;
    showPlan(plan);
    const a = plan.adapter;
    $('adapter').textContent = `WebGPU adapter: ${a.name || '(unnamed)'} (${a.backend}, ${a.device_type}); largest storage binding ${mb(a.limits.max_storage_buffer_binding_size)}`;
    $('generate').disabled = false;
    document.body.dataset.state = 'loaded';
    document.body.dataset.source = engine.source;
    document.body.dataset.loadMs = String(Math.round(performance.now() - loadStarted));
    document.body.dataset.wasmBytes = String(plan.wasmMemoryBytes);
    showCatalogue().catch(() => {});
  } catch (e) {
    document.body.dataset.state = '';
    showError(`${e.message}${e.code ? ` (${e.code})` : ''}`);
  } finally {
    busy(false);
  }
}

$('load-url').onclick = () => load($('model-url').value);
$('model-file').onchange = (e) => { if (e.target.files[0]) load(e.target.files[0]); };
$('forget').onclick = async () => {
  const url = $('model-url').value;
  if (!url || !engine) return;
  await engine.models.delete(url).catch(() => false);
  await showCatalogue();
};

async function generate() {
  const chat = $('chat').checked;
  const text = $('prompt').value;
  clearError();
  $('metrics').textContent = '';
  $('generate').disabled = true;
  $('stop').disabled = false;
  document.body.dataset.state = 'generating';
  if (!chat) $('messages').replaceChildren();
  if (chat) addMessage('user', text, false);
  const show = addMessage('assistant', chat ? '' : text, chat);
  const common = {
    max_tokens: Number($('max-tokens').value) || 64,
    temperature: Number($('temperature').value) || 0,
    stream: true,
    stream_options: { include_usage: true },
  };
  // Prompt lookup: drafts from n-gram matches in the prompt and output, checked by the model
  // in one step (same tokens, fewer steps when the answer repeats the prompt).
  if ($('speculative').value !== 'off') common.speculative = { drafter: $('speculative').value };
  const messages = [...history, { role: 'user', content: text }];
  const before = (await engine.plan()).stats;
  const start = performance.now();
  const arrivals = [];
  let answer = '';
  let finish = null;
  let usage = null;
  try {
    current = chat
      ? await engine.chat.completions.create({ messages, ...common })
      : await engine.completions.create({ prompt: text, ...common });
    for await (const chunk of current) {
      const c = chunk.choices[0];
      const piece = chat ? c?.delta?.content : c?.text;
      if (piece) {
        arrivals.push(performance.now());
        answer += piece;
        show(chat ? answer : text + answer);
      }
      if (c?.finish_reason) finish = c.finish_reason;
      if (chunk.usage) usage = chunk.usage;
    }
  } catch (e) {
    if (e.code === 'aborted') finish = 'cancelled';
    else showError(`${e.message}${e.code ? ` (${e.code})` : ''}`);
  }
  current = null;
  finish ??= 'cancelled';
  if (chat && finish !== 'cancelled') {
    history.push({ role: 'user', content: text }, { role: 'assistant', content: answer });
    $('prompt').value = '';
  }
  // Serving metrics from the chunks' arrival: TTFT to the first text, TPOT over the gaps
  // after it (a chunk carries a token's text, or several when speculation accepts drafts).
  const tokens = usage?.completion_tokens ?? arrivals.length;
  const ttft = arrivals.length ? arrivals[0] - start : null;
  const tpot = arrivals.length > 1 && tokens > 1 ? (arrivals[arrivals.length - 1] - arrivals[0]) / (tokens - 1) : null;
  const after = (await engine.plan()).stats;
  const steps = after.steps - before.steps;
  const f = (v, d = 1) => (v == null ? '–' : v.toFixed(d));
  const sp = common.speculative ? ` · speculative (prompt lookup): ${tokens} tokens in ${steps} engine steps` : '';
  $('metrics').textContent = `${tokens} tokens · finish: ${finish} · TTFT ${f(ttft, 0)} ms · ${f(tpot ? 1000 / tpot : null)} tokens/s · TPOT ${f(tpot)} ms${sp}`;
  $('generate').disabled = false;
  $('stop').disabled = true;
  document.body.dataset.outputText = answer;
  document.body.dataset.timings = JSON.stringify({ ttftMs: ttft, tpotMs: tpot, tokensPerS: tpot ? 1000 / tpot : null, tokens, steps });
  document.body.dataset.state = 'done';
}

$('generate').onclick = () => { generate(); };
$('stop').onclick = () => { if (current) current.abort(); };
// A new conversation whenever chat is switched, and on "New chat".
const newChat = () => { history = []; $('messages').replaceChildren(); $('metrics').textContent = ''; };
$('chat').onchange = newChat;
$('new-chat').onclick = newChat;

// Optional query parameters (the end-to-end test uses them): ?model=URL offers that model
// first, and &autoload=1 loads it at once.
if (params.get('model')) {
  const o = new Option(params.get('model'), params.get('model'), true, true);
  o.dataset.query = '1';
  $('model-url').add(o);
}
adapterInfo()
  .then((a) => { $('adapter').textContent = `WebGPU adapter: ${a.name || '(unnamed)'} (${a.backend}, ${a.device_type})`; })
  .catch((e) => showError(e.message));
showCatalogue()
  .catch((e) => showError(`The model list failed: ${e.message}`))
  .finally(() => { if (params.get('autoload')) $('load-url').click(); });
