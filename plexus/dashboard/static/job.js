// A job's page: its header, live charts (uPlot), rounds with each site's outcome, its config. Follows the
// job through /api/jobs/ID/events (EventSource; the server pushes a whole view after each burst of events).
"use strict";

(() => {
  const {api, post, me, el, setText, clear, time, number, privacyText, epsilonText, showError} = Plexus;
  const jobId = decodeURIComponent(location.pathname.split("/")[2] || "");
  const base = `/api/jobs/${encodeURIComponent(jobId)}`;
  const SITE_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                        "#bcbd22", "#7f7f7f"];
  const FIRST_EVAL = ["accuracy", "auc", "loss"];   // drawn first, in this order; other eval metrics after
  const ROUND_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];
  const charts = new Map();        // chart key -> {plot, signature, box, xRange}
  const siteColours = new Map();   // site -> its colour on every chart
  let who = null;
  let stream = null;

  function renderHeader(job) {
    document.title = `${job.name} · Plexus`;
    setText("job-name", job.name);
    const status = document.getElementById("job-status");
    status.textContent = job.status;
    status.className = `badge status-${job.status.replace(/[^a-z_]/g, "")}`;
    const unit = job.mode === "async" ? "Version" : "Round";
    setText("round-counter", `${unit} ${job.round} of ${job.total_rounds}`);
    const bar = document.getElementById("progress");
    bar.max = Math.max(job.total_rounds, 1);
    bar.value = job.round;
    const facts = clear(document.getElementById("facts"));
    const eps = epsilonText(job.privacy);
    for (const [term, value] of [["Job ID", job.job_id], ["Strategy", job.strategy], ["Mode", job.mode],
                                 ["Privacy", privacyText(job.privacy) + (eps ? ` (${eps})` : "")],
                                 ["Submitted by", job.submitted_by], ["Created", time(job.created)],
                                 ["Updated", time(job.updated)]]) {
      facts.append(el("div", {}, el("dt", {}, term), el("dd", {}, value)));
    }
    const message = setText("job-message", job.message);
    message.hidden = !job.message;
    renderAbort(job);
  }

  function renderAbort(job) {
    const holder = document.getElementById("actions");
    const existing = document.getElementById("abort");
    if (!who || !who.can_abort || job.terminal) {
      if (existing) existing.remove();
      return;
    }
    if (existing) return;
    const button = el("button", {id: "abort", type: "button", class: "danger"}, "Abort job");
    button.addEventListener("click", async () => {
      if (!window.confirm(`Abort job ${job.name} (${job.job_id})? Its open round ends now; this cannot be undone.`)) {
        return;
      }
      button.disabled = true;
      try {
        const reply = await post(`${base}/abort`);
        showError(null);
        setText("last-event", `abort sent: the job is ${reply.summary.status}`);
        render(await api(base));
      } catch (e) {
        showError(e);
        button.disabled = false;
      }
    });
    holder.append(button);
  }

  function renderEvent(event) {
    if (!event) return;
    const where = [event.round ? `round ${event.round}` : "", event.site].filter(Boolean).join(", ");
    setText("last-event", `latest event (${time(event.unix_s)}): ${event.kind}${where ? ` — ${where}` : ""}` +
            (event.message ? `: ${event.message}` : ""));
  }

  // Series [{label, points: [[x, y]], stroke, width, dash}] drawn on one x axis (the round).
  function aligned(series) {
    const xs = [...new Set(series.flatMap(s => s.points.map(p => p[0])))].sort((a, b) => a - b);
    const columns = series.map(s => {
      const at = new Map(s.points.map(p => [p[0], p[1]]));
      return xs.map(x => (at.has(x) ? at.get(x) : null));
    });
    return [xs, ...columns];
  }

  // xFrom..xTo: the rounds the job will have (more if the data goes further), so a young job's curve starts at
  // the left of an axis as long as the job, on whole rounds.
  function chart(key, title, xLabel, yLabel, series, xFrom, xTo) {
    let entry = charts.get(key);
    const data = aligned(series);
    const signature = series.map(s => s.label).join("\u0000");
    const points = data.slice(1).reduce((n, column) => n + column.filter(v => v !== null).length, 0);
    if (!entry) {
      const box = el("div", {class: "chart", id: `chart-${key}`});
      const card = el("figure", {class: "chart-card"}, el("figcaption", {}, title), box);
      document.getElementById("charts").append(card);
      entry = {box, plot: null, signature: null};
      charts.set(key, entry);
      new ResizeObserver(() => {
        if (entry.plot) entry.plot.setSize({width: chartWidth(box), height: 240});
      }).observe(box);
    }
    // uPlot widens a one-point x range to 0..100 before asking the range function: use the data's own end.
    const xs = data[0];
    entry.xRange = [xFrom, Math.max(xTo, xs.length ? xs[xs.length - 1] : xTo, xFrom + 1)];
    if (entry.plot && entry.signature === signature) {
      entry.plot.setData(data);
    } else {
      if (entry.plot) entry.plot.destroy();
      const options = {
        width: chartWidth(entry.box), height: 240,
        scales: {x: {time: false, range: () => entry.xRange}},
        axes: [{label: xLabel, labelSize: 20, size: 36, incrs: ROUND_STEPS},
               {label: yLabel, labelSize: 20, size: 56}],
        series: [{label: xLabel}, ...series.map(s => ({
          label: s.label, stroke: s.stroke, width: s.width || 1.5, dash: s.dash, spanGaps: true,
          points: {show: true, size: s.width > 2 ? 6 : 4},
          value: (u, v) => (v === null || v === undefined ? "—" : number(v)),
        }))],
        legend: {show: true},
        cursor: {drag: {x: false, y: false}},
      };
      entry.plot = new uPlot(options, data, entry.box);
      entry.signature = signature;
    }
    entry.box.dataset.points = String(points);
  }

  function chartWidth(box) {
    return Math.max(260, Math.floor(box.getBoundingClientRect().width));
  }

  // A site keeps its colour on every chart of the page, however many sites a chart has.
  function colourOf(site) {
    if (!siteColours.has(site)) siteColours.set(site, SITE_COLOURS[siteColours.size % SITE_COLOURS.length]);
    return siteColours.get(site);
  }

  function curveSeries(curve) {
    const series = [];
    if (curve.global.length) {
      series.push({label: "all sites (weighted mean)", points: curve.global, stroke: "#111111", width: 2.5});
    }
    for (const site of Object.keys(curve.sites).sort()) {
      series.push({label: site, points: curve.sites[site], stroke: colourOf(site), width: 1.5});
    }
    return series;
  }

  function renderCharts(job) {
    const evals = job.curves.eval || {};
    const trains = job.curves.train || {};
    const sites = new Set(Object.values(job.curves).flatMap(named => Object.values(named))
      .flatMap(curve => Object.keys(curve.sites)));
    [...sites].sort().forEach(colourOf);
    const evalNames = Object.keys(evals).sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
    for (const name of evalNames) {
      chart(`eval-${safeKey(name)}`, `${name}: global model of each round, on the sites' held-out rows`,
            "model of round", name, curveSeries(evals[name]), 0, job.total_rounds);
    }
    for (const name of Object.keys(trains).sort()) {
      chart(`train-${safeKey(name)}`, `${name}: the sites' local models trained in each round`, "round", name,
            curveSeries(trains[name]), 1, job.total_rounds);
    }
    if (job.epsilon.length || job.epsilon_target !== null) {
      const series = [{label: "ε spent", points: job.epsilon, stroke: "#6a3d9a", width: 2.5}];
      if (job.epsilon_target !== null) {
        const rounds = job.epsilon.length ? job.epsilon.map(p => p[0]) : [1, Math.max(job.total_rounds, 1)];
        series.push({label: "target ε", points: rounds.map(r => [r, job.epsilon_target]), stroke: "#d62728",
                     width: 1.5, dash: [6, 4]});
      }
      chart("epsilon", "privacy spent (ε, δ as configured) after each round", "round", "ε", series, 1,
            job.total_rounds);
    }
    document.getElementById("no-charts").hidden = charts.size > 0;
  }

  function rank(name) {
    const i = FIRST_EVAL.indexOf(name);
    return i < 0 ? FIRST_EVAL.length : i;
  }

  function safeKey(name) {
    return name.replace(/[^A-Za-z0-9_-]/g, "_");
  }

  function clock(unixSeconds) {
    return unixSeconds ? new Date(unixSeconds * 1000).toLocaleTimeString() : "";
  }

  function took(r) {
    return r.opened && r.closed ? `${(r.closed - r.opened).toFixed(1)} s` : "";
  }

  function siteOutcomes(r) {
    const cell = el("td", {class: "sites"});
    for (const s of r.sites) {
      cell.append(el("div", {class: `site-outcome outcome-${s.status.replace(/[^a-z_]/g, "")}`},
        el("span", {class: "site-name"}, s.site), " ", el("span", {class: "site-status"}, s.status),
        s.reason ? el("span", {class: "site-reason"}, s.reason) : null));
    }
    return cell;
  }

  function renderRounds(job) {
    const body = clear(document.querySelector("#rounds-table tbody"));
    for (const r of job.rounds.slice().reverse()) {
      body.append(el("tr", {class: "round", dataset: {round: r.round}},
        el("td", {}, r.round), el("td", {}, Plexus.badge(r.status)),
        el("td", {class: "nowrap", title: time(r.opened)}, clock(r.opened)), el("td", {class: "nowrap"}, took(r)), el("td", {}, r.total_samples || ""), siteOutcomes(r),
        el("td", {class: "message"}, r.message)));
    }
  }

  function renderAsync(job) {
    const view = job.async;
    document.getElementById("async-section").hidden = !view;
    if (!view) return;
    const mode = view.mode;
    setText("async-mode", `buffer ${mode.buffer}, max staleness ${mode.max_staleness}, staleness weight ` +
            `${mode.staleness.fn}; ${view.refused_stale} update(s) refused as too stale; ` +
            `${view.buffer.updates.length} waiting for version ${view.buffer.version}`);
    const sites = clear(document.querySelector("#async-sites tbody"));
    view.sites.forEach(s => sites.append(el("tr", {}, el("td", {}, s.site), el("td", {}, s.contributions),
                                             el("td", {}, s.refused_stale))));
    const stale = clear(document.querySelector("#async-staleness tbody"));
    view.staleness.forEach(b => stale.append(el("tr", {}, el("td", {}, b.staleness), el("td", {}, b.updates))));
  }

  function render(job) {
    renderHeader(job);
    renderCharts(job);
    renderRounds(job);
    renderAsync(job);
    const config = document.getElementById("config");
    if (config.textContent !== job.config_yaml) config.textContent = job.config_yaml;
  }

  function setLive(text, kind) {
    const live = setText("live", text);
    live.className = `live ${kind || ""}`;
  }

  function follow() {
    stream = new EventSource(`${base}/events`);
    stream.addEventListener("open", () => setLive("● live", "on"));
    stream.addEventListener("job", message => {
      const job = JSON.parse(message.data);
      render(job);
      renderEvent(job.event);
      showError(null);
    });
    stream.addEventListener("end", () => {
      stream.close();
      setLive("job over", "off");
    });
    stream.addEventListener("problem", message => {
      showError(new Error(`live updates: ${JSON.parse(message.data).error}; retrying`));
      setLive("reconnecting…", "warn");
    });
    stream.addEventListener("error", () => {
      if (stream.readyState === EventSource.CLOSED) setLive("not live: reload the page", "warn");
      else setLive("reconnecting…", "warn");
    });
  }

  async function main() {
    try {
      who = await me();
      const job = await api(base);
      render(job);
      if (job.terminal) setLive("job over", "off");
      else follow();
    } catch (e) {
      showError(e);
    }
  }

  main();
})();
