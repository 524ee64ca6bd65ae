// mkdocs-material calls mermaid.initialize() with its own theme CSS and renders each diagram into
// a closed shadow root, where the page's CSS cannot reach. Two fixes therefore go into that call:
// - arrowheads take the edge colour of the palette (mermaid 11 prefixes its marker ids, so the
//   theme's own arrowhead rule misses them: dark grey on the dark palette);
// - sequence diagrams wrap long messages and notes inside their boxes instead of overflowing;
// - flowcharts are spaced tighter, so that a wide one is scaled down less;
// - below 1220 px each rendered SVG gets a min-width at which its 16 px text is still 9.5 px: the
//   diagram then scrolls sideways (div.mermaid has overflow-x: auto in extra.css) instead of
//   shrinking to 4 px text. mkdocs-material calls the global mermaid.render, so it is wrapped here.
(function () {
  if (typeof mermaid === "undefined" || typeof mermaid.initialize !== "function") {
    return;
  }
  var css =
    "marker path, marker circle, .arrowheadPath {" +
    " fill: var(--md-mermaid-edge-color) !important;" +
    " stroke: var(--md-mermaid-edge-color) !important; }";
  var initialize = mermaid.initialize.bind(mermaid);
  mermaid.initialize = function (config) {
    var merged = Object.assign({}, config);
    merged.themeCSS = (merged.themeCSS || "") + css;
    merged.sequence = Object.assign({}, merged.sequence, { wrap: true, actorMargin: 110 });
    // Flowcharts: tighter spacing, so that a wide one is scaled down less (readable text).
    merged.flowchart = Object.assign({}, merged.flowchart, { nodeSpacing: 24, rankSpacing: 36,
                                                             padding: 8, wrappingWidth: 260 });
    return initialize(merged);
  };
  var MIN_TEXT_PX = 9.5, FONT_PX = 16;
  var render = mermaid.render.bind(mermaid);
  mermaid.render = function () {
    return render.apply(null, arguments).then(function (out) {
      var box = /viewBox="[-\d.]+ [-\d.]+ ([\d.]+) [\d.]+"/.exec(out.svg);
      var id = /^<svg[^>]* id="([\w-]+)"/.exec(out.svg);
      if (box && id) {
        var width = parseFloat(box[1]);
        var min = Math.ceil(Math.min(width, width * MIN_TEXT_PX / FONT_PX));
        // Below the 1220 px layout only: on a desktop a wide diagram still fits the column.
        out.svg = out.svg.replace(/^<svg[^>]*>/, function (tag) {
          return tag + "<style>@media screen and (max-width: 1219px) { #" + id[1] +
                 " { min-width: " + min + "px; } }</style>";
        });
      }
      return out;
    });
  };
})();
