// The memory calculator of the memory_estimate page and the decision guide: every element
// <div class="memory-calculator"></div> becomes a form and a bar of bytes per GPU.
//
// The arithmetic is a line-by-line port of recipes/memory_estimate.py (model_state_per_rank,
// activation_bytes, gpu_memory, EstimateConfig's checks), in the same order of operations, so
// that the doubles come out equal: tests/test_docs.py opens the built page with ?check=[...],
// which runs each configuration through the form and lists what the page shows, and compares
// it with the Python function. Change both together.
//
// Inputs come from the URL too (?model=llama3-70b&gpus=64&tp=8...), and every change writes them
// back to it, so a configuration can be shared as a link. No library, no network: works offline.
(function () {
  "use strict";

  // recipes.memory_estimate.MODEL_PRESETS
  var PRESETS = {
    "100m": { params: 110578176, layers: 12, hidden: 768, heads: 12, vocab: 16384 },
    "gpt2-xl": { params: 1.558e9, layers: 48, hidden: 1600, heads: 25, vocab: 50257 },
    "llama3-8b": { params: 8.03e9, layers: 32, hidden: 4096, heads: 32, vocab: 128256 },
    "llama2-13b": { params: 13.0e9, layers: 40, hidden: 5120, heads: 40, vocab: 32000 },
    "llama3-70b": { params: 70.6e9, layers: 80, hidden: 8192, heads: 64, vocab: 128256 },
    "llama3-405b": { params: 405.9e9, layers: 126, hidden: 16384, heads: 128, vocab: 128256 },
  };
  // LAYOUTS: bytes per parameter of (params, grads, optimizer state)
  var LAYOUTS = { "adam-mixed": [2, 2, 12], "adam-fp32": [4, 4, 8] };
  // PRECISIONS: precision -> (layout, bytes per activation element)
  var PRECISIONS = { mixed: ["adam-mixed", 2], autocast: ["adam-fp32", 2], fp32: ["adam-fp32", 4] };
  // STAGES: the parts each stage divides by the ranks it shards over
  var SHARDS = { ddp: [], zero1: ["optimizer"], zero2: ["optimizer", "grad"],
                 zero3: ["optimizer", "grad", "param"] };
  var GIB = Math.pow(2, 30);

  // The form's fields: [name, label, kind, choices or help]. `gpus` is world_size * tp * pp.
  var FIELDS = [
    ["Model", [
      ["model", "Model", "select", [["custom", "custom (the fields below)"],
        ["100m", "toy 100m (recipes.toy)"], ["gpt2-xl", "GPT-2 XL 1.5B"],
        ["llama3-8b", "Llama 3.1 8B"], ["llama2-13b", "Llama 2 13B"],
        ["llama3-70b", "Llama 3.1 70B"], ["llama3-405b", "Llama 3.1 405B"]]],
      ["params", "Parameters", "text", "e.g. 7e9"],
      ["layers", "Layers (L)", "int"],
      ["hidden", "Hidden size (h)", "int"],
      ["heads", "Attention heads (a)", "int"],
      ["vocab", "Vocabulary (V)", "int"],
    ]],
    ["Parallelism", [
      ["gpus", "GPUs in all", "int"],
      ["strategy", "Data parallel", "select", [["ddp", "DDP (replicated)"],
        ["zero1", "ZeRO-1: optimizer sharded"],
        ["zero2", "ZeRO-2 / FSDP SHARD_GRAD_OP"],
        ["zero3", "ZeRO-3 / FSDP FULL_SHARD / fully_shard"],
        ["hsdp", "HSDP: shard in groups, replicate across"]]],
      ["shard_size", "HSDP group size", "int"],
      ["tp", "Tensor parallel (TP)", "int"],
      ["pp", "Pipeline stages (PP)", "int"],
      ["sequence_parallel", "Sequence parallel (with TP)", "bool"],
      ["offload", "CPU offload of the sharded state", "bool"],
    ]],
    ["Training", [
      ["precision", "Precision", "select", [["mixed", "bf16 mixed: 2+2+12 B/param"],
        ["autocast", "fp32 params, bf16 autocast: 4+4+8"], ["fp32", "fp32: 4+4+8, fp32 acts"]]],
      ["seq_len", "Sequence length (s)", "int"],
      ["micro_batch", "Micro-batch per GPU (b)", "int"],
      ["checkpointing", "Activation checkpointing", "select", [["none", "none"],
        ["selective", "selective (attention)"], ["full", "full (every layer)"]]],
      ["flash_attention", "Flash attention (SDPA)", "bool"],
    ]],
    ["GPU", [
      ["gpu", "GPU memory", "select", [["24", "24 GiB (RTX 4090, A10)"],
        ["40", "40 GiB (A100 40GB)"], ["48", "48 GiB (L40S, A6000)"],
        ["80", "80 GiB (A100, H100)"], ["141", "141 GiB (H200)"],
        ["192", "192 GiB (B200, MI300X)"], ["custom", "custom"]]],
      ["gpu_memory_gib", "GPU memory, GiB", "text"],
    ]],
  ];
  var DEFAULTS = {
    model: "llama3-8b", params: "8.03e9", layers: 32, hidden: 4096, heads: 32, vocab: 128256,
    gpus: 8, strategy: "zero3", shard_size: 8, tp: 1, pp: 1, sequence_parallel: true,
    offload: false, precision: "mixed", seq_len: 4096, micro_batch: 1, checkpointing: "none",
    flash_attention: true, gpu: "80", gpu_memory_gib: "80",
  };
  var PARTS = [["param_bytes", "Parameters"], ["grad_bytes", "Gradients"],
               ["optimizer_bytes", "Optimizer state"], ["activation_bytes", "Activations"]];

  // ---- the arithmetic: recipes/memory_estimate.py ----

  function modelStatePerRank(params, worldSize, stage, layout, offload) {
    var device = { param_bytes: 0, grad_bytes: 0, optimizer_bytes: 0 };
    var host = { param_bytes: 0, grad_bytes: 0, optimizer_bytes: 0 };
    [["param", layout[0]], ["grad", layout[1]], ["optimizer", layout[2]]].forEach(function (p) {
      var sharded = SHARDS[stage].indexOf(p[0]) >= 0;
      var nbytes = sharded ? p[1] * params / worldSize : p[1] * params;
      (offload && sharded ? host : device)[p[0] + "_bytes"] = nbytes;
    });
    return { device: device, host: host };
  }

  function activationBytes(cfg) {
    var s = cfg.seq_len, b = cfg.micro_batch, h = cfg.hidden, a = cfg.heads, t = cfg.tp;
    var scale = PRECISIONS[cfg.precision][1] / 2;
    var sp = cfg.sequence_parallel && t > 1;
    var scores = cfg.flash_attention ? 0 : 5 * a * s / (h * t);
    var linear = sp ? 34 / t : (t > 1 ? 10 + 24 / t : 34);
    var fullLayer = s * b * h * (linear + scores) * scale;
    var perLayer, recompute;
    if (cfg.checkpointing === "none") {
      perLayer = fullLayer; recompute = 0;
    } else if (cfg.checkpointing === "selective") {
      perLayer = s * b * h * linear * scale; recompute = 0;
    } else {
      perLayer = 2 * s * b * h / (sp ? t : 1) * scale; recompute = fullLayer;
    }
    var layersPerStage = Math.floor(cfg.layers / cfg.pp);
    var logits = 4 * s * b * cfg.vocab / t;
    var first = cfg.pp * layersPerStage * perLayer + recompute;
    var last = layersPerStage * perLayer + recompute + logits;
    return Math.max(first, last);
  }

  function gpuMemory(cfg) {
    var layout = PRECISIONS[cfg.precision][0];
    var stage = cfg.strategy === "hsdp" ? "zero3" : cfg.strategy;
    var shardOver = cfg.strategy === "hsdp" ? cfg.shard_size : cfg.world_size;
    var paramsPerGpu = cfg.params / (cfg.tp * cfg.pp);
    var state = modelStatePerRank(paramsPerGpu, shardOver, stage, LAYOUTS[layout], cfg.offload);
    var device = state.device;
    device.activation_bytes = activationBytes(cfg);
    device.total_bytes = 0 + device.param_bytes + device.grad_bytes + device.optimizer_bytes +
      device.activation_bytes;
    var host = 0 + state.host.param_bytes + state.host.grad_bytes + state.host.optimizer_bytes;
    var capacity = cfg.gpu_memory_gib * GIB;
    return { device: device, host_bytes: host, gpu_bytes: capacity, shard_over: shardOver,
             fits: device.total_bytes <= capacity };
  }

  // EstimateConfig's checks, plus the one the form adds (GPUs = world_size * tp * pp).
  function toConfig(v) {
    var cfg = {};
    Object.keys(v).forEach(function (k) { cfg[k] = v[k]; });
    if (v.model !== "custom") {
      Object.keys(PRESETS[v.model]).forEach(function (k) { cfg[k] = PRESETS[v.model][k]; });
    }
    cfg.params = Number(cfg.params);
    cfg.gpu_memory_gib = Number(v.gpu === "custom" ? v.gpu_memory_gib : v.gpu);
    if (!(cfg.params > 0) || !isFinite(cfg.params)) {
      return "Parameters must be a number > 0, e.g. 7e9";
    }
    if (!(cfg.gpu_memory_gib > 0) || !isFinite(cfg.gpu_memory_gib)) {
      return "GPU memory must be a number of GiB > 0";
    }
    var ints = ["layers", "hidden", "heads", "vocab", "gpus", "shard_size", "tp", "pp", "seq_len",
                "micro_batch"];
    for (var i = 0; i < ints.length; i++) {
      var x = Number(cfg[ints[i]]);
      if (!(Number.isInteger(x) && x >= 1)) {
        return ints[i] + " must be a whole number >= 1";
      }
      cfg[ints[i]] = x;
    }
    if (cfg.gpus % (cfg.tp * cfg.pp)) {
      return "GPUs (" + cfg.gpus + ") must divide by TP x PP (" + cfg.tp * cfg.pp + ")";
    }
    cfg.world_size = cfg.gpus / (cfg.tp * cfg.pp);
    if (cfg.layers % cfg.pp) {
      return "layers=" + cfg.layers + " must divide by pp=" + cfg.pp;
    }
    if (cfg.heads % cfg.tp) {
      return "heads=" + cfg.heads + " must divide by tp=" + cfg.tp;
    }
    if (cfg.strategy === "hsdp" && cfg.world_size % cfg.shard_size) {
      return "HSDP group size " + cfg.shard_size + " must divide the data-parallel ranks (" +
        cfg.world_size + ")";
    }
    if (cfg.offload && cfg.strategy === "ddp") {
      return "DDP has no CPU offload: pick a ZeRO strategy or untick offload";
    }
    return cfg;
  }

  // ---- the page ----

  function gib(x) {
    return (x / GIB).toFixed(2) + " GiB";
  }

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") { node.textContent = attrs[k]; } else { node.setAttribute(k, attrs[k]); }
    });
    (children || []).forEach(function (c) { node.appendChild(c); });
    return node;
  }

  function build(root, index) {
    var inputs = {};
    var form = el("form", { class: "mc-form", autocomplete: "off" });
    FIELDS.forEach(function (group) {
      var fieldset = el("fieldset", { class: "mc-group" }, [el("legend", { text: group[0] })]);
      group[1].forEach(function (f) {
        var id = "mc" + index + "-" + f[0];
        var input;
        if (f[2] === "select") {
          input = el("select", { id: id }, f[3].map(function (c) {
            return el("option", { value: c[0], text: c[1] });
          }));
        } else if (f[2] === "bool") {
          input = el("input", { id: id, type: "checkbox" });
        } else {
          input = el("input", f[2] === "int"
            ? { id: id, type: "number", min: "1", step: "1", inputmode: "numeric" }
            : { id: id, type: "text", inputmode: "decimal", placeholder: f[3] || "" });
        }
        input.name = f[0];
        inputs[f[0]] = input;
        var label = el("label", { for: id, text: f[1] });
        fieldset.appendChild(el("div", { class: "mc-field mc-" + f[2] },
          f[2] === "bool" ? [input, label] : [label, input]));
      });
      form.appendChild(fieldset);
    });
    // The verdict and the bar stay in sight (sticky at the bottom of the screen) while the form
    // scrolls by on a phone; the table of numbers follows them.
    var out = el("div", { class: "mc-out", "aria-live": "polite" });
    var details = el("div", { class: "mc-details" });
    root.appendChild(form);
    root.appendChild(out);
    root.appendChild(details);

    function read() {
      var v = {};
      Object.keys(inputs).forEach(function (k) {
        v[k] = inputs[k].type === "checkbox" ? inputs[k].checked : inputs[k].value;
      });
      return v;
    }

    function write(v) {
      Object.keys(v).forEach(function (k) {
        if (!inputs[k]) { return; }
        if (inputs[k].type === "checkbox") {
          inputs[k].checked = v[k] === true || v[k] === "true" || v[k] === "1";
        } else {
          inputs[k].value = String(v[k]);
        }
      });
      if (v.gpu_memory_gib !== undefined && v.gpu === undefined) {
        var known = FIELDS[3][1][0][3].some(function (c) {
          return c[0] === String(v.gpu_memory_gib);
        });
        inputs.gpu.value = known ? String(v.gpu_memory_gib) : "custom";
      }
    }

    function render() {
      var v = read();
      var preset = v.model !== "custom";
      ["params", "layers", "hidden", "heads", "vocab"].forEach(function (k) {
        if (preset) { inputs[k].value = String(PRESETS[v.model][k]); }
        inputs[k].disabled = preset;
      });
      if (v.gpu !== "custom") { inputs.gpu_memory_gib.value = v.gpu; }
      inputs.gpu_memory_gib.disabled = v.gpu !== "custom";
      inputs.shard_size.disabled = v.strategy !== "hsdp";
      inputs.sequence_parallel.disabled = Number(v.tp) <= 1;
      out.textContent = "";
      details.textContent = "";
      var cfg = toConfig(read());
      if (typeof cfg === "string") {
        out.appendChild(el("p", { class: "mc-error", role: "alert", text: cfg }));
        return null;
      }
      var r = gpuMemory(cfg);
      var scaleMax = Math.max(r.device.total_bytes, r.gpu_bytes);
      var bar = el("div", { class: "mc-bar", role: "img",
        "aria-label": gib(r.device.total_bytes) + " of " + gib(r.gpu_bytes) });
      PARTS.forEach(function (p, i) {
        bar.appendChild(el("span", { class: "mc-seg mc-c" + i, title: p[1],
          style: "width:" + (100 * r.device[p[0]] / scaleMax) + "%" }));
      });
      bar.appendChild(el("span", { class: "mc-limit",
        style: "left:" + (100 * r.gpu_bytes / scaleMax) + "%" }));
      var rows = PARTS.concat([["total_bytes", "Total on the GPU"]]).map(function (p, i) {
        return el("tr", { class: p[0] === "total_bytes" ? "mc-total" : "" }, [
          el("td", {}, [el("span", { class: "mc-key mc-c" + i }), el("span", { text: p[1] })]),
          el("td", { class: "mc-num", "data-part": p[0], "data-bytes": String(r.device[p[0]]),
                     text: gib(r.device[p[0]]) }),
        ]);
      });
      rows.push(el("tr", {}, [el("td", { text: "GPU memory" }),
        el("td", { class: "mc-num", "data-part": "gpu_bytes", "data-bytes": String(r.gpu_bytes),
                   text: gib(r.gpu_bytes) })]));
      if (r.host_bytes) {
        rows.push(el("tr", {}, [el("td", { text: "In host memory (offloaded)" }),
          el("td", { class: "mc-num", "data-part": "host_bytes",
                     "data-bytes": String(r.host_bytes), text: gib(r.host_bytes) })]));
      }
      var left = r.gpu_bytes - r.device.total_bytes;
      var verdict = el("p", { class: "mc-verdict " + (r.fits ? "mc-fits" : "mc-over"),
        "data-fits": String(r.fits),
        text: (r.fits ? "Fits: " + gib(left) + " left" : "Does not fit: " + gib(-left) + " over") +
          " on each of " + cfg.gpus + " GPUs (" + cfg.world_size + " data-parallel x TP " +
          cfg.tp + " x PP " + cfg.pp + "; model state sharded over " + r.shard_over + ")." });
      out.appendChild(verdict);
      out.appendChild(bar);
      details.appendChild(el("table", { class: "mc-table" }, [el("tbody", {}, rows)]));
      return r;
    }

    function shown() {
      var figures = {};
      details.querySelectorAll("[data-part]").forEach(function (td) {
        figures[td.getAttribute("data-part")] = { bytes: Number(td.getAttribute("data-bytes")),
                                                  text: td.textContent };
      });
      var verdict = out.querySelector("[data-fits]");
      var error = out.querySelector(".mc-error");
      return { figures: figures,
               fits: verdict ? verdict.getAttribute("data-fits") === "true" : null,
               error: error ? error.textContent : null };
    }

    var query = new URLSearchParams(window.location.search);
    var start = Object.assign({}, DEFAULTS);
    query.forEach(function (value, key) { if (key in DEFAULTS) { start[key] = value; } });
    if (query.has("gpu_memory_gib") && !query.has("gpu")) { delete start.gpu; }
    write(start);
    render();

    form.addEventListener("input", function () {
      render();
      var v = read(), changed = new URLSearchParams();
      Object.keys(v).forEach(function (k) {
        if (String(v[k]) !== String(DEFAULTS[k])) { changed.set(k, v[k]); }
      });
      var search = changed.toString();
      history.replaceState(null, "", window.location.pathname + (search ? "?" + search : "") +
        window.location.hash);
    });
    form.addEventListener("submit", function (e) { e.preventDefault(); });

    // ?check=[{...}, ...]: each configuration through the form, then what the page shows.
    if (index === 0 && query.has("check")) {
      var results = JSON.parse(query.get("check")).map(function (c) {
        write(Object.assign({}, DEFAULTS, c));
        render();
        return shown();
      });
      window.memoryCalculatorCheck = results;
      // Also in the page, for `chromium --headless --dump-dom`; wrapped: no sideways scroll.
      root.appendChild(el("pre", { id: "memory-calculator-check", text: JSON.stringify(results),
                                   style: "white-space: pre-wrap; word-break: break-all" }));
    }
  }

  document.querySelectorAll("div.memory-calculator").forEach(build);
  window.memoryCalculatorPresets = PRESETS;
})();
