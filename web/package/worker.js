// lantern-web's Web Worker: it owns the WebGPU device and the model, so the page stays
// responsive while weights download and upload and tokens are generated. index.js creates
// it; nothing else talks to it.
//
// In: { rid, op, ...args } with op load | submit | cancel | tokenize | detokenize | plan |
// unload | catalogue | adapter. Out: { rid, value } or { rid, error: { message, code } } per
// message, { rid, progress } while loading, and { events: id, chunks, done, response, error }
// after each engine step for every request that produced something.
//
// Messages are handled one at a time, between engine steps (a step must not overlap another
// call into the engine): while requests run, the loop alternates "handle what arrived" and
// "one step", so a new request joins the running batch at the next step.
import init, { Engine, Lantern } from './lantern.js';

const queue = [];
let wake = null;
let engine = null;

self.onmessage = ({ data }) => {
  queue.push(data);
  if (wake) { wake(); wake = null; }
};

const post = (m) => self.postMessage(m);
const failure = (e) => ({ message: (e && e.message) || String(e), code: (e && e.code) || 'internal' });

// A catalogue name becomes its file under `modelBase`; any other string is a URL, relative
// to the page (`pageBase`, as fetch would take it there); anything else is a File or bytes.
function resolveModel(model, modelBase, pageBase) {
  if (typeof model !== 'string') return model;
  const entry = Lantern.catalogue().find((m) => m.name === model);
  return entry ? new URL(entry.file, modelBase).href : new URL(model, pageBase).href;
}

async function handle(m) {
  switch (m.op) {
    case 'load': {
      if (engine) { try { engine.unload(); } catch { /* already */ } engine = null; }
      const progress = (p) => post({ rid: m.rid, progress: { model: 'target', ...p } });
      const target = await Engine.load(resolveModel(m.model, m.modelBase, m.pageBase), m.options, progress);
      if (m.draft) {
        const draftProgress = (p) => post({ rid: m.rid, progress: { model: 'draft', ...p } });
        const draft = await Engine.load(resolveModel(m.draft, m.modelBase, m.pageBase), { ...m.options, memoryBudget: undefined }, draftProgress);
        target.setDraft(draft);
      }
      engine = target;
      return { modelId: engine.modelId, source: engine.source, plan: engine.plan() };
    }
    case 'catalogue': return Lantern.catalogue();
    case 'adapter': return await Lantern.adapter();
  }
  if (!engine) throw Object.assign(new Error('no model is loaded (it failed to load or was unloaded)'), { code: 'not_loaded' });
  switch (m.op) {
    case 'submit': return engine.submit(m.endpoint, m.body);
    case 'cancel': engine.cancel(m.id); return null;
    case 'tokenize': return Array.from(engine.tokenize(m.text));
    case 'detokenize': return engine.detokenize(Uint32Array.from(m.ids));
    case 'plan': return engine.plan();
    case 'unload': engine.unload(); engine = null; return null;
    default: throw Object.assign(new Error(`unknown operation ${m.op}`), { code: 'internal' });
  }
}

function flush() {
  if (!engine) return;
  for (const id of engine.pending()) {
    const d = engine.drain(id);
    if (d.chunks.length || d.done) post({ events: id, ...d });
  }
}

async function main() {
  await init();
  for (;;) {
    while (queue.length) {
      const m = queue.shift();
      try {
        post({ rid: m.rid, value: await handle(m) });
      } catch (e) {
        post({ rid: m.rid, error: failure(e) });
      }
    }
    if (engine && !engine.idle()) {
      try {
        await engine.step();
      } catch (e) {
        // The step's requests got the error; `flush` delivers it to each.
        console.error('lantern-web: engine step failed:', e);
      }
      flush();
    } else {
      flush();
      if (!queue.length) await new Promise((r) => { wake = r; });
    }
  }
}

main().catch((e) => post({ fatal: failure(e) }));
