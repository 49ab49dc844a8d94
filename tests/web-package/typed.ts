// What a TypeScript app writes against lantern-web: tests/web.rs type-checks it (strict) with
// tsc against the installed package's index.d.ts; it is never run.
import { adapterInfo, createEngine, listModels, LanternError } from 'lantern-web';
import OpenAI from 'openai';

async function main(out: HTMLElement) {
  const adapter = await adapterInfo();
  const offered = (await listModels()).filter((m) => m.cached || adapter.capabilities.shader_f16);
  console.log(adapter.name, offered.map((m) => `${m.name} ${m.bytes}`));
  const engine = await createEngine({ model: 'smollm2-135m', onProgress: (p) => console.log(p) });
  const stream = await engine.chat.completions.create({
    messages: [{ role: 'user', content: 'Write a haiku about lanterns.' }],
    stream: true,
    max_tokens: 64,
  });
  for await (const chunk of stream) out.textContent += chunk.choices[0]?.delta?.content ?? '';
  const r = await engine.chat.completions.create({ messages: [{ role: 'user', content: 'hi' }], response_format: { type: 'json_object' } });
  console.log(r.choices[0].message.content, r.usage?.total_tokens);
  const c = await engine.completions.create({ prompt: 'Once', max_tokens: 4 });
  console.log(c.choices[0].text);
  const ids: number[] = await engine.tokenize('hello');
  console.log(ids, await engine.plan());
  const client = new OpenAI({ baseURL: 'http://lantern.local/v1', apiKey: 'none', fetch: engine.fetch, dangerouslyAllowBrowser: true });
  console.log(await client.models.list());
  try { await createEngine({ model: 'x' }); } catch (e) { if (e instanceof LanternError) console.log(e.code); }
  await engine.unload();
}
main(document.body);
