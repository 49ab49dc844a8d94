// The browser comparison's page code (compare.mjs drives it): Lantern through the
// lantern-web package against wllama (llama.cpp compiled to wasm, from npm) on the same GGUF,
// in the same Chromium. Each function loads a model, streams one greedy raw completion and
// reports load time, time to the first token, decode tokens/s and the token counts.
import { createEngine } from 'lantern-web';
import { Wllama } from '@wllama/wllama';

const now = () => performance.now();

// Time a stream of OpenAI completion chunks: (first token ms after t0, last token ms, tokens).
async function timeStream(stream, t0, count) {
  let first = null;
  let last = null;
  let tokens = 0;
  let usage = null;
  let timings = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    if (chunk.timings) timings = chunk.timings;
    const text = chunk.choices?.[0]?.text ?? chunk.choices?.[0]?.delta?.content ?? '';
    if (text) {
      const t = now();
      first ??= t;
      last = t;
      tokens += count ? 1 : 0;
    }
  }
  return { ttftMs: first - t0, decodeMs: last - first, tokens, usage, timings };
}

function rates(r, promptTokens, tokens) {
  return { ...r, promptTokens, tokens, prefillTokS: promptTokens / (r.ttftMs / 1000), decodeTokS: (tokens - 1) / (r.decodeMs / 1000) };
}

window.bench = {
  async lantern(model, prompt, maxTokens) {
    const t0 = now();
    const engine = await createEngine({ model });
    const loadMs = now() - t0;
    const promptTokens = (await engine.tokenize(prompt)).length;
    const t1 = now();
    const stream = await engine.completions.create({ prompt, max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true } });
    const r = await timeStream(stream, t1, false);
    const plan = await engine.plan();
    await engine.unload();
    return { engine: 'lantern-web (WebGPU)', adapter: plan.adapter, loadMs, ...rates(r, r.usage?.prompt_tokens ?? promptTokens, r.usage?.completion_tokens ?? 0) };
  },

  async wllama(url, prompt, maxTokens, gpu) {
    // llama.cpp's log says where the weights went ("CPU model buffer size", or a WebGPU
    // device's); the run reports it.
    const buffers = [];
    const note = (...a) => { const t = a.join(' '); if (/model buffer size/.test(t)) buffers.push(t.trim()); };
    const logger = { ...console, debug: note, log: note, info: note, warn: console.warn, error: console.error };
    const w = new Wllama({ default: new URL('./wllama.wasm', import.meta.url).href }, { suppressNativeLog: false, logger });
    const t0 = now();
    await w.loadModelFromUrl(url, { n_ctx: 1024, n_gpu_layers: gpu ? 99999 : 0, n_threads: navigator.hardwareConcurrency || 1 });
    const loadMs = now() - t0;
    const t1 = now();
    const stream = await w.createCompletion({ prompt, max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true } });
    const r = await timeStream(stream, t1, true);
    const promptTokens = r.usage?.prompt_tokens ?? r.timings?.prompt_n ?? NaN;
    const threads = w.isMultithread?.() ? 'multi-thread' : 'single-thread';
    await w.exit();
    const onGpu = buffers.some((b) => !/^\S*\s*CPU/.test(b.replace(/^load_tensors:\s*/, '')));
    const asked = gpu ? 'WebGPU allowed' : 'CPU only';
    return { engine: `wllama (${asked}; ran on ${onGpu ? 'WebGPU' : `CPU, wasm ${threads}`})`, weights: buffers, loadMs, ...rates(r, promptTokens, r.tokens) };
  },
};
document.body.dataset.ready = '1';
