// Live regions: an element with data-poll-url has its contents replaced by that URL's HTML
// every data-poll-ms; with data-poll-until-done it stops once the server says X-Poll-Done.
document.querySelectorAll("[data-poll-url]").forEach(function (el) {
  var ms = parseInt(el.dataset.pollMs || "1500", 10);
  function tick() {
    fetch(el.dataset.pollUrl, {credentials: "same-origin", cache: "no-store"})
      .then(function (r) {
        if (r.status === 401) {
          location.href = "/sign-in?next=" + encodeURIComponent(location.pathname);
          return;
        }
        if (!r.ok) { setTimeout(tick, ms * 2); return; }
        var done = r.headers.get("X-Poll-Done") === "1";
        return r.text().then(function (html) {
          el.innerHTML = html;
          if (!(done && el.dataset.pollUntilDone)) setTimeout(tick, ms);
        });
      })
      .catch(function () { setTimeout(tick, ms * 2); });
  }
  if (el.dataset.pollActive !== "false") setTimeout(tick, ms);
});
