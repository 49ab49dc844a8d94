// Drives the package test app (index.html + dist/app.js, built by build.mjs from the
// installed lantern-web tarball) in Debian's Chromium (WebGPU on SwiftShader) and prints one
// JSON report on stdout; tests/web.rs compares it with the native runtime.
//
// node tests/web-package/run.mjs --models DIR --config CONFIG.json [--chromium PATH]
// CONFIG.json: { "model": "smollm2-135m", "prompt": "...", "maxTokens": 8,
//                "truncated": "file name of a truncated GGUF in DIR" }
// Each check runs in the page the way an app would call the package; a check that throws
// fails the run (exit 1) with its name.
import { readFileSync, mkdtempSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { tmpdir } from 'node:os';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { launchChromium, startServer } from '../../web/testkit.mjs';

const args = process.argv.slice(2);
const opt = (name, dflt) => { const i = args.indexOf(`--${name}`); return i >= 0 ? args[i + 1] : dflt; };
const here = dirname(fileURLToPath(import.meta.url));
const config = JSON.parse(readFileSync(opt('config'), 'utf8'));
const log = (...a) => console.error('[web-package]', ...a);

const server = await startServer(['--root', here, '--models', opt('models')]);
const ctx = await launchChromium(chromium, mkdtempSync(join(tmpdir(), 'lantern-pkg-')), opt('chromium'));
const report = { checks: {} };
let failed = null;
try {
  const page = ctx.pages()[0] || await ctx.newPage();
  page.on('console', (m) => log('console:', m.text()));
  page.on('pageerror', (e) => log('page error:', e.message));
  page.setDefaultTimeout(600_000);
  await page.goto(server.url);
  await page.waitForFunction(() => document.body.dataset.ready === '1');
  const check = async (name, fn, arg) => {
    const t0 = Date.now();
    try {
      report.checks[name] = await page.evaluate(fn, arg);
      log(`${name}: ok in ${((Date.now() - t0) / 1000).toFixed(1)} s`, JSON.stringify(report.checks[name]).slice(0, 300));
    } catch (e) {
      failed ??= `${name}: ${e.message}`;
      log(`${name}: FAILED: ${e.message}`);
      throw e;
    }
  };
  const c = config;
  const user = (content) => [{ role: 'user', content }];

  // The README's example: load by catalogue name, stream a greedy chat answer.
  await check('stream', async (c) => {
    const t0 = performance.now();
    window.engine = await window.app.chat(c.model, c.prompt, c.maxTokens);
    return { text: window.app.out.textContent, ms: performance.now() - t0, plan: await window.engine.plan() };
  }, c);

  await check('json_schema', async (c) => {
    const schema = { type: 'object', properties: { sky_is_blue: { type: 'boolean' } }, required: ['sky_is_blue'], additionalProperties: false };
    const r = await window.engine.chat.completions.create({
      messages: [{ role: 'user', content: 'Is the sky blue? Answer in JSON.' }],
      max_tokens: 16,
      temperature: 0,
      response_format: { type: 'json_schema', json_schema: { name: 'answer', strict: true, schema } },
    });
    const content = r.choices[0].message.content;
    const v = JSON.parse(content);
    if (typeof v.sky_is_blue !== 'boolean' || Object.keys(v).length !== 1) throw new Error(`does not match the schema: ${content}`);
    return { content, finish: r.choices[0].finish_reason };
  }, c);

  await check('tool_call', async () => {
    const r = await window.engine.chat.completions.create({
      messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
      max_tokens: 40,
      temperature: 0,
      tools: [{ type: 'function', function: { name: 'get_weather', description: 'The weather in a city', parameters: { type: 'object', properties: { city: { type: 'string', enum: ['Paris', 'Berlin', 'Tokyo'] } }, required: ['city'], additionalProperties: false } } }],
      tool_choice: { type: 'function', function: { name: 'get_weather' } },
    });
    const call = r.choices[0].message.tool_calls?.[0];
    if (!call || call.function.name !== 'get_weather') throw new Error(`no forced call: ${JSON.stringify(r.choices[0])}`);
    const a = JSON.parse(call.function.arguments);
    if (!['Paris', 'Berlin', 'Tokyo'].includes(a.city)) throw new Error(`arguments ${call.function.arguments}`);
    return { arguments: a, finish: r.choices[0].finish_reason };
  });

  await check('abort', async (c) => {
    const ac = new AbortController();
    const stream = await window.engine.chat.completions.create({ messages: [{ role: 'user', content: c.prompt }], max_tokens: 64, temperature: 0, stream: true, signal: ac.signal });
    let chunks = 0;
    let code = null;
    try {
      for await (const _ of stream) {
        if (++chunks === 2) ac.abort();
      }
    } catch (e) {
      if (!(e instanceof window.app.LanternError)) throw e;
      code = e.code;
    }
    if (code !== 'aborted') throw new Error(`the aborted stream ended with ${code} after ${chunks} chunks`);
    // The engine goes on: the next request completes.
    const r = await window.engine.completions.create({ prompt: 'The capital of France is', max_tokens: 2, temperature: 0 });
    return { chunks, code, next: r.choices[0].text };
  }, c);

  await check('two_at_once', async (c) => {
    const ask = (content) => window.engine.chat.completions.create({ messages: [{ role: 'user', content }], max_tokens: 4, temperature: 0 });
    const [a, b] = await Promise.all([ask(c.prompt), ask('Name a colour.')]);
    return { a: a.choices[0].message.content, b: b.choices[0].message.content };
  }, c);

  await check('openai_client', async (c) => {
    const client = window.app.openaiClient(window.engine);
    const models = await client.models.list();
    const model = models.data[0].id;
    const whole = await client.chat.completions.create({ model, messages: [{ role: 'user', content: c.prompt }], max_tokens: c.maxTokens, temperature: 0 });
    let streamed = '';
    const stream = await client.chat.completions.create({ model, messages: [{ role: 'user', content: c.prompt }], max_tokens: c.maxTokens, temperature: 0, stream: true });
    for await (const chunk of stream) streamed += chunk.choices[0]?.delta?.content ?? '';
    return { model, text: whole.choices[0].message.content, streamed, usage: whole.usage };
  }, c);

  // Typed errors, and the page (and its engine) still usable afterwards.
  await check('errors', async (c) => {
    const code = async (options) => {
      try {
        const e = await window.app.createEngine(options);
        await e.unload();
        return 'loaded';
      } catch (e) {
        if (!(e instanceof window.app.LanternError)) throw new Error(`not a LanternError: ${e}`);
        return { code: e.code, message: e.message };
      }
    };
    const r = {
      missing: await code({ model: 'models/no-such-model.gguf' }),
      truncated: await code({ model: `models/${c.truncated}` }),
      tooSmall: await code({ model: c.model, memoryBudget: 8 * 1024 * 1024 }),
    };
    const after = await window.engine.completions.create({ prompt: 'One, two,', max_tokens: 2, temperature: 0 });
    r.after = after.choices[0].text;
    return r;
  }, c);
  report.adapter = await page.evaluate(() => window.engine.plan().then((p) => p.adapter ?? null));
} catch (e) {
  failed ??= e.message;
} finally {
  await ctx.close();
  server.proc.kill();
}
report.failed = failed;
console.log(JSON.stringify(report));
process.exit(failed ? 1 : 0);
