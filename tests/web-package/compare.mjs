// Lantern (the lantern-web package, on the browser's WebGPU adapter) against wllama 3
// (llama.cpp in wasm, from npm: its WebGPU backend and its CPU build) on the same GGUF files,
// one fresh Chromium each, served with cross-origin isolation so wllama can use threads.
// Prints a Markdown table and one JSON line per run; peak resident memory is sampled from
// /proc (web/testkit.mjs).
//
// node tests/web-package/compare.mjs --models DIR [--runs lantern,wllama-gpu,wllama-cpu]
//      [--prompt TEXT] [--max-tokens N] [--chromium PATH] FILE.gguf...
import { mkdtempSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { tmpdir } from 'node:os';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { launchChromium, samplePeaks, startServer } from '../../web/testkit.mjs';

const args = process.argv.slice(2);
const opt = (name, dflt) => { const i = args.indexOf(`--${name}`); return i >= 0 ? args[i + 1] : dflt; };
const flags = new Set(['models', 'runs', 'prompt', 'max-tokens', 'chromium']);
const files = args.filter((a, i) => !a.startsWith('--') && !(i > 0 && flags.has(args[i - 1].slice(2))));
const here = dirname(fileURLToPath(import.meta.url));
const runs = opt('runs', 'lantern,wllama-gpu,wllama-cpu').split(',');
const prompt = opt('prompt', 'def quicksort(arr):\n    """Sort a list of numbers in ascending order."""\n');
const maxTokens = Number(opt('max-tokens', 32));
const log = (...a) => console.error('[compare]', ...a);

const server = await startServer(['--root', here, '--models', opt('models'), '--isolate']);

const rows = [];
try {
  for (const file of files) {
    for (const run of runs) {
      const profile = mkdtempSync(join(tmpdir(), 'lantern-compare-'));
      const ctx = await launchChromium(chromium, profile, opt('chromium'));
      try {
        const page = ctx.pages()[0] || await ctx.newPage();
        page.setDefaultTimeout(1_800_000);
        page.on('pageerror', (e) => log('page error:', e.message));
        // What each runtime says about its backend (llama.cpp names the devices it uses).
        page.on('console', (m) => { if (process.env.COMPARE_CONSOLE || /webgpu|ggml_|backend|device|thread/i.test(m.text())) log('console:', m.text().slice(0, 200)); });
        await page.goto(`${server.url}bench.html`);
        await page.waitForFunction(() => document.body.dataset.ready === '1');
        const stop = samplePeaks(profile);
        const url = `${server.url}models/${file}`;
        const r = run === 'lantern'
          ? await page.evaluate(([u, p, n]) => window.bench.lantern(u, p, n), [url, prompt, maxTokens])
          : await page.evaluate(([u, p, n, g]) => window.bench.wllama(u, p, n, g), [url, prompt, maxTokens, run === 'wllama-gpu']);
        const peak = stop();
        const row = { model: file, ...r, peakMb: peak, crossOriginIsolated: await page.evaluate(() => self.crossOriginIsolated) };
        rows.push(row);
        console.log(JSON.stringify(row));
        log(`${file} ${r.engine}: load ${(r.loadMs / 1000).toFixed(1)} s, prefill ${r.prefillTokS.toFixed(1)} tok/s, decode ${r.decodeTokS.toFixed(2)} tok/s, ${r.tokens} tokens, renderer peak ${peak.renderer} MB, GPU process ${peak['gpu-process']} MB`);
      } catch (e) {
        log(`${file} ${run}: FAILED: ${e.message}`);
        rows.push({ model: file, engine: run, error: e.message.split('\n')[0] });
      } finally {
        await ctx.close();
        rmSync(profile, { recursive: true, force: true });
      }
    }
  }
} finally {
  server.proc.kill();
}
console.log('\n| model | runtime | load | prefill | decode | tokens | renderer peak | GPU process peak |\n|---|---|---|---|---|---|---|---|');
for (const r of rows) {
  if (r.error) { console.log(`| ${r.model} | ${r.engine} | failed: ${r.error} | | | | | |`); continue; }
  console.log(`| ${r.model} | ${r.engine} | ${(r.loadMs / 1000).toFixed(1)} s | ${r.prefillTokS.toFixed(1)} tok/s | ${r.decodeTokS.toFixed(2)} tok/s | ${r.promptTokens} + ${r.tokens} | ${r.peakMb.renderer ?? '-'} MB | ${r.peakMb['gpu-process'] ?? '-'} MB |`);
}
