// Bundle app.js with esbuild and put the package's worker, JS bindings and wasm next to the
// bundle: esbuild leaves `new URL('./worker.js', import.meta.url)` as it is, so those files
// must sit beside dist/app.js (bundlers that copy such assets, like Vite, do it themselves).
import { build } from 'esbuild';
import { copyFileSync, mkdirSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const pkg = dirname(createRequire(import.meta.url).resolve('lantern-web/worker.js'));
mkdirSync(join(here, 'dist'), { recursive: true });
await build({ entryPoints: [join(here, 'app.js')], bundle: true, format: 'esm', outfile: join(here, 'dist', 'app.js'), logLevel: 'warning' });
for (const f of ['worker.js', 'lantern.js', 'lantern_bg.wasm']) copyFileSync(join(pkg, f), join(here, 'dist', f));
// The comparison page (compare.mjs) with wllama beside the package, when it is installed.
let wllama = null;
try { wllama = dirname(createRequire(import.meta.url).resolve('@wllama/wllama')); } catch { /* not installed */ }
if (wllama) {
  await build({ entryPoints: [join(here, 'bench.js')], bundle: true, format: 'esm', outfile: join(here, 'dist', 'bench.js'), logLevel: 'warning' });
  copyFileSync(join(wllama, 'wasm', 'wllama.wasm'), join(here, 'dist', 'wllama.wasm'));
}
console.log(`built dist/app.js with lantern-web from ${pkg}`);
