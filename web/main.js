// The page: asks the worker for the adapter, loads a model (same-origin URL or a file from
// disk) with a progress bar, shows the memory plan, streams generated text with TTFT and
// tokens/s, and stops a generation. Every failure becomes a sentence in the error box.
const $ = (id) => document.getElementById(id);
const worker = new Worker(new URL('./worker.js', import.meta.url), { type: 'module' });
const send = (msg) => worker.postMessage(msg);

const mb = (b) => `${(b / 1e6).toFixed(1)} MB`;
let loadStarted = 0;
// The conversation so far in chat mode: [{ role, content }].
let history = [];
let asked = '';

function showError(text) {
  $('error').textContent = text;
  $('error').hidden = false;
}

function busy(loading) {
  $('load-url').disabled = loading;
  $('model-file').disabled = loading;
}

function showPlan(plan, info) {
  const m = plan.memory;
  const weights = Object.entries(m.weights).map(([k, d]) => `${k} ${mb(d.bytes + d.scale_bytes)}`).join(', ');
  const rows = [
    ['model', `${plan.model} (${plan.config.num_layers} layers, d_model ${plan.config.hidden_size}, vocab ${plan.config.vocab_size})`],
    ['from', plan.source === 'cache' ? 'the browser cache (no download)' : plan.source],
    ['adapter', `${info.name || '(unnamed)'} · ${info.backend} · shader-f16 ${info.capabilities.shader_f16 ? 'yes' : 'no'} · subgroups ${info.capabilities.subgroups ? 'yes' : 'no'}`],
    ['weights', `${mb(plan.weightBytes)} (${weights})`],
    ['KV cache', `${mb(plan.kvCacheBytes)} · ${m.kv_dtype} · ${m.kv_pages} pages of ${m.kv_page_size} tokens` +
      (m.kv_window_ring ? ` · sliding layers keep a ${m.kv_window_ring.pages * m.kv_window_ring.page_size}-token ring (${mb(m.kv_ring_bytes)})` : '')],
    ['workspace', mb(m.workspace)],
    ['context', `${plan.context} tokens`],
    ['budget', m.budget ? `${mb(m.budget)} (${m.budget_source})` : 'browsers do not report GPU memory: the KV cache holds one full context'],
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

// The catalogue (the same models `lantern models` lists), each offered when this site serves
// its file under models/ (a HEAD request says), else named with the command that fetches it.
async function showCatalogue(models) {
  const select = $('model-url');
  const keep = [...select.options].filter((o) => o.dataset.query);
  const missing = [];
  const options = [];
  for (const m of models) {
    const url = `models/${m.file}`;
    const label = `${m.name} (${m.family}, ${m.params}, ${m.format}, ${mb(m.bytes)})`;
    let here = false;
    try { here = (await fetch(url, { method: 'HEAD' })).ok; } catch { here = false; }
    if (here) options.push(new Option(label, url, m.default && !keep.length, m.default && !keep.length));
    else missing.push(m.name);
  }
  select.replaceChildren(...keep, ...options);
  $('catalogue-note').textContent = missing.length
    ? `Not on this site: ${missing.join(', ')} (\`lantern fetch NAME\` puts a model where the demo server serves it).`
    : '';
}

worker.onmessage = ({ data }) => {
  switch (data.type) {
    case 'catalogue':
      showCatalogue(data.models).then(() => { if (params.get('autoload')) $('load-url').click(); });
      break;
    case 'adapter': {
      const a = data.info;
      $('adapter').textContent = `WebGPU adapter: ${a.name || '(unnamed)'} (${a.backend}, ${a.device_type}); features: ${a.features.join(', ') || 'none beyond the core'}; largest storage binding ${mb(a.limits.max_storage_buffer_binding_size)}`;
      break;
    }
    case 'progress': {
      $('progress').hidden = false;
      $('progress-bar').value = data.total > 0 ? data.done / data.total : 0;
      const what = { download: 'Downloading', cache: 'Reading from the browser cache', read: 'Reading the file', upload: 'Uploading to the GPU' }[data.phase] || data.phase;
      const amount = data.phase === 'upload' ? `layer ${data.done} of ${data.total}` : `${mb(data.done)} of ${mb(data.total)}`;
      $('progress-label').textContent = `${what}: ${amount}`;
      break;
    }
    case 'loaded':
      busy(false);
      $('progress-label').textContent = 'Ready.';
      $('progress-bar').value = 1;
      showPlan(data.plan, data.info);
      $('generate').disabled = false;
      document.body.dataset.state = 'loaded';
      document.body.dataset.source = data.plan.source;
      document.body.dataset.loadMs = String(Math.round(performance.now() - loadStarted));
      document.body.dataset.wasmBytes = String(data.plan.wasmMemoryBytes);
      break;
    case 'text':
      $('output').textContent += data.piece;
      break;
    case 'done': {
      const r = data.result;
      if ($('chat').checked && r.finishReason !== 'cancelled') {
        history.push({ role: 'user', content: asked }, { role: 'assistant', content: r.text });
        $('prompt').value = '';
        $('output').textContent += '\n\n';
      }
      const f = (v, d = 1) => (v == null ? '–' : v.toFixed(d));
      const spec = r.speculative;
      const sp = !spec ? ''
        : spec.plain_reason ? ` · speculative: decoded plainly (${spec.plain_reason})`
        : ` · speculative: ${spec.accepted}/${spec.proposed} drafts accepted, ${f(spec.tokens_per_step, 2)} tokens per step, gain ${f(spec.expected_gain, 2)}x expected, ${f(spec.measured_gain, 2)}x measured`;
      $('metrics').textContent = `${r.outputIds.length} tokens · finish: ${r.finishReason} · TTFT ${f(r.ttftMs, 0)} ms · ${f(r.tokensPerS)} tokens/s · TPOT ${f(r.tpotMs)} ms${sp}`;
      $('generate').disabled = false;
      $('stop').disabled = true;
      document.body.dataset.outputIds = JSON.stringify(r.outputIds);
      // The serving metrics, for tests and benchmarks that drive the page.
      document.body.dataset.timings = JSON.stringify({ ttftMs: r.ttftMs, tpotMs: r.tpotMs, tokensPerS: r.tokensPerS, host: r.host ?? null });
      document.body.dataset.state = 'done';
      break;
    }
    case 'error':
      busy(false);
      $('generate').disabled = !document.body.dataset.state;
      $('stop').disabled = true;
      showError(data.during === 'adapter' ? data.message : `${data.message}`);
      document.body.dataset.state = document.body.dataset.state === 'generating' ? 'loaded' : (document.body.dataset.state || '');
      document.body.dataset.error = data.message;
      break;
  }
};
worker.onerror = (e) => showError(`The worker failed to start: ${e.message}. Was the wasm package built (scripts/web.sh)?`);

function load(msg) {
  $('error').hidden = true;
  $('generate').disabled = true;
  busy(true);
  loadStarted = performance.now();
  document.body.dataset.state = 'loading';
  send(msg);
}

$('load-url').onclick = () => load({ type: 'loadUrl', url: new URL($('model-url').value, location.href).href });
$('model-file').onchange = (e) => { if (e.target.files[0]) load({ type: 'loadFile', file: e.target.files[0] }); };
function transcript() {
  return history.map((t) => `${t.role === 'user' ? 'You' : 'Assistant'}: ${t.content}\n\n`).join('');
}

$('generate').onclick = () => {
  const chat = $('chat').checked;
  asked = $('prompt').value;
  $('error').hidden = true;
  $('output').textContent = chat ? `${transcript()}You: ${asked}\n\nAssistant: ` : '';
  $('metrics').textContent = '';
  $('generate').disabled = true;
  $('stop').disabled = false;
  document.body.dataset.state = 'generating';
  send({ type: 'generate', prompt: asked, options: {
    chat,
    history: chat ? history : [],
    maxTokens: Number($('max-tokens').value) || 64,
    temperature: Number($('temperature').value) || 0,
    // Prompt lookup: drafts from n-gram matches in the prompt and output, checked by the
    // model in one step (same tokens, fewer steps when the answer repeats the prompt).
    speculative: $('speculative').value === 'off' ? undefined : { drafter: $('speculative').value },
  } });
};
// A new conversation whenever chat is switched, and on "New chat".
const newChat = () => { history = []; $('output').textContent = ''; $('metrics').textContent = ''; };
$('chat').onchange = newChat;
$('new-chat').onclick = newChat;
$('stop').onclick = () => send({ type: 'cancel' });

// Optional query parameters (the end-to-end test uses them): ?model=URL loads it at once.
const params = new URLSearchParams(location.search);
if (params.get('model')) {
  const o = new Option(params.get('model'), params.get('model'), true, true);
  o.dataset.query = '1';
  $('model-url').add(o);
}
send({ type: 'adapter' });
send({ type: 'catalogue' });
