// Build the demo as any app using lantern-web would: bundle main.js (which imports the
// package installed from its tarball, marked and DOMPurify) with esbuild into web/site/,
// next to the page, its stylesheet and the package's worker, JS bindings and wasm (esbuild
// leaves `new URL('./worker.js', import.meta.url)` as it is, so those files must sit beside
// the bundle). scripts/web.sh runs it; web/serve.mjs serves web/site/.
import { build } from 'esbuild';
import { copyFileSync, mkdirSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const site = join(here, 'site');
const pkg = dirname(createRequire(import.meta.url).resolve('lantern-web/worker.js'));
mkdirSync(site, { recursive: true });
await build({ entryPoints: [join(here, 'main.js')], bundle: true, format: 'esm', minify: true, outfile: join(site, 'main.js'), logLevel: 'warning' });
for (const f of ['index.html', 'style.css']) copyFileSync(join(here, f), join(site, f));
for (const f of ['worker.js', 'lantern.js', 'lantern_bg.wasm']) copyFileSync(join(pkg, f), join(site, f));
console.error(`web/build.mjs: web/site/ built with lantern-web from ${pkg}`);
