// The Web Worker that owns the model: the page stays responsive while weights download,
// upload and tokens are generated. Messages in: adapter, catalogue, loadUrl, loadFile,
// generate, cancel. Messages out: adapter, catalogue, progress, loaded, text, done, error.
import init, { Lantern } from './pkg/lantern.js';

const ready = init();
let model = null;

const reply = (msg) => self.postMessage(msg);
const message = (e) => (e && e.message) || String(e);
const progress = (p) => reply({ type: 'progress', ...p });

async function loaded(m) {
  model = m;
  reply({ type: 'loaded', plan: m.plan(), info: m.info() });
}

self.onmessage = async ({ data }) => {
  try {
    await ready;
    switch (data.type) {
      case 'adapter':
        reply({ type: 'adapter', info: await Lantern.adapter() });
        break;
      case 'catalogue':
        reply({ type: 'catalogue', models: Lantern.catalogue() });
        break;
      case 'loadUrl':
        model = null;
        await loaded(await Lantern.loadUrl(data.url, data.options ?? {}, progress));
        break;
      case 'loadFile':
        model = null;
        await loaded(await Lantern.loadFile(data.file, data.options ?? {}, progress));
        break;
      case 'generate': {
        if (!model) throw new Error('Load a model first.');
        const result = await model.generate(data.prompt, data.options ?? {}, (piece) => reply({ type: 'text', piece }));
        reply({ type: 'done', result });
        break;
      }
      case 'cancel':
        if (model) model.cancel();
        break;
    }
  } catch (e) {
    reply({ type: 'error', during: data.type, message: message(e) });
  }
};
