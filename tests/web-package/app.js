// A web app using lantern-web as the README shows: this file is bundled by esbuild
// (build.mjs) from the installed package, like any app would be. It exposes what the test
// driver (run.mjs) calls on `window.app`.
import { createEngine, LanternError } from 'lantern-web';
import OpenAI from 'openai';

const out = document.getElementById('out');

async function chat(model, prompt, maxTokens) {
  const engine = await createEngine({ model, onProgress: (p) => { out.textContent = `loading: ${JSON.stringify(p)}`; } });
  const stream = await engine.chat.completions.create({
    messages: [{ role: 'user', content: prompt }],
    max_tokens: maxTokens,
    temperature: 0,
    stream: true,
  });
  out.textContent = '';
  for await (const chunk of stream) out.textContent += chunk.choices[0]?.delta?.content ?? '';
  return engine;
}

// An openai client whose requests the engine answers in the page.
function openaiClient(engine) {
  return new OpenAI({ baseURL: 'http://lantern.local/v1', apiKey: 'none', fetch: engine.fetch, dangerouslyAllowBrowser: true });
}

window.app = { createEngine, LanternError, chat, openaiClient, out };
document.body.dataset.ready = '1';
