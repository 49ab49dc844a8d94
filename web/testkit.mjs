// What the browser tests and benchmarks share (web/e2e.mjs, tests/web-package/run.mjs and
// compare.mjs): the static server on loopback, headless Chromium with WebGPU, and the
// resident memory of its processes (Linux /proc; a run's processes are told by its profile).
import { spawn } from 'node:child_process';
import { readFileSync, readdirSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));

// Start web/serve.mjs on a free loopback port with `args` (--models, --root, --isolate):
// resolves to { proc, url } once it listens.
export function startServer(args) {
  return new Promise((resolve, reject) => {
    const p = spawn(process.execPath, [join(here, 'serve.mjs'), '--port', '0', ...args], { stdio: ['ignore', 'pipe', 'inherit'] });
    p.stdout.on('data', (d) => {
      const m = String(d).match(/http:\/\/[^ ]+\//);
      if (m) resolve({ proc: p, url: m[0] });
    });
    p.on('exit', (c) => reject(new Error(`the static server exited with ${c}`)));
  });
}

// Headless Chromium (playwright-core's `chromium`, from the caller's node_modules) with
// WebGPU on, in the persistent profile folder `profile`; `options` adds to playwright's.
export function launchChromium(chromium, profile, executablePath, options = {}) {
  return chromium.launchPersistentContext(profile, {
    executablePath: executablePath ?? '/usr/bin/chromium',
    headless: true,
    args: ['--enable-unsafe-webgpu', '--no-sandbox', '--disable-quic', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    ...options,
  });
}

// Resident memory (MB) of the browser's processes by type (renderer, gpu-process, ...): the
// processes whose command line names this run's profile, and their descendants (Linux /proc).
export function processMemory(profile) {
  const procs = [];
  for (const d of readdirSync('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const cmd = readFileSync(`/proc/${d}/cmdline`, 'utf8').split('\0');
      const stat = readFileSync(`/proc/${d}/stat`, 'utf8');
      const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
      const rss = Number((readFileSync(`/proc/${d}/status`, 'utf8').match(/VmRSS:\s+(\d+)/) || [0, 0])[1]) / 1024;
      procs.push({ pid: Number(d), ppid, cmd, rss });
    } catch { /* gone */ }
  }
  const ours = new Set(procs.filter((p) => p.cmd.some((a) => a.includes(profile))).map((p) => p.pid));
  for (let grew = true; grew;) {
    grew = false;
    for (const p of procs) if (!ours.has(p.pid) && ours.has(p.ppid)) { ours.add(p.pid); grew = true; }
  }
  const by = {};
  for (const p of procs.filter((p) => ours.has(p.pid))) {
    // Chromium's children rewrite their command line into one space-separated string.
    const t = (p.cmd.join(' ').match(/--type=(\S+)/) || [null, 'browser'])[1];
    by[t] = Math.max(by[t] || 0, p.rss);
  }
  return by;
}

// Samples processMemory every 100 ms until stopped; the peak per process type.
export function samplePeaks(profile) {
  const peak = {};
  const take = () => { for (const [t, v] of Object.entries(processMemory(profile))) peak[t] = Math.max(peak[t] || 0, v); };
  take();
  const timer = setInterval(take, 100);
  return () => { clearInterval(timer); take(); return Object.fromEntries(Object.entries(peak).map(([k, v]) => [k, Math.round(v)])); };
}
