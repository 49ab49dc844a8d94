// A small static server for the demo: the built site (web/site/, from web/build.mjs) at /,
// and the models folder at /models/ (so the page loads the default model from its own
// origin). Loopback only unless --host says otherwise. Usage: node web/serve.mjs [--port
// 8080] [--host 127.0.0.1] [--models DIR] [--root DIR]
// (--root: serve another folder at / instead of web/site/, e.g. the npm package's test app;
// --isolate: cross-origin isolation headers, which multi-threaded wasm such as wllama's needs).
import { createServer } from 'node:http';
import { createReadStream, statSync } from 'node:fs';
import { extname, join, normalize, resolve, sep } from 'node:path';
import { homedir } from 'node:os';
import { fileURLToPath } from 'node:url';

const args = process.argv.slice(2);
const opt = (name, dflt) => { const i = args.indexOf(`--${name}`); return i >= 0 ? args[i + 1] : dflt; };
const root = resolve(opt('root', fileURLToPath(new URL('./site/', import.meta.url))));
const cacheRoot = process.env.LANTERN_CACHE_DIR || (process.env.XDG_CACHE_HOME ? join(process.env.XDG_CACHE_HOME, 'lantern') : join(homedir(), '.cache', 'lantern'));
const models = resolve(opt('models', join(cacheRoot, 'models')));
const port = Number(opt('port', process.env.PORT || 8080));
const host = opt('host', '127.0.0.1');
const isolate = args.includes('--isolate');

const types = { '.html': 'text/html; charset=utf-8', '.js': 'text/javascript', '.mjs': 'text/javascript', '.css': 'text/css', '.wasm': 'application/wasm', '.json': 'application/json', '.png': 'image/png', '.gguf': 'application/octet-stream' };

// A path inside `base`, or null (no escaping with ..).
function inside(base, rel) {
  const p = normalize(join(base, decodeURIComponent(rel)));
  return p === base || p.startsWith(base + sep) ? p : null;
}

const server = createServer((req, res) => {
  const url = new URL(req.url, 'http://x');
  let file = url.pathname.startsWith('/models/') ? inside(models, url.pathname.slice('/models/'.length)) : inside(root, url.pathname === '/' ? 'index.html' : url.pathname.slice(1));
  let st = null;
  try { st = file && statSync(file); } catch { st = null; }
  if (!st || !st.isFile()) {
    res.writeHead(404, { 'content-type': 'text/plain' });
    res.end(`not found: ${url.pathname}\n`);
    return;
  }
  const isolation = isolate ? { 'cross-origin-opener-policy': 'same-origin', 'cross-origin-embedder-policy': 'require-corp' } : {};
  res.writeHead(200, { 'content-type': types[extname(file)] || 'application/octet-stream', 'content-length': st.size, 'cache-control': 'no-cache', ...isolation });
  if (req.method === 'HEAD') { res.end(); return; }
  createReadStream(file).pipe(res);
});
server.listen(port, host, () => {
  const { port: p } = server.address();
  console.log(`Lantern demo on http://${host}:${p}/ (models from ${models})`);
});
