// MCP Edge console, rollouts pages. Progressive enhancement only: every form works without it.
// - A rollout's command buttons (form[data-reason], re-rendered by live updates) send the text
//   of the page's one reason field (#action-reason), which lives outside the live region so
//   an update never wipes what is being typed.
// - On the new-rollout form, choosing a model offers that model's versions (#version-list)
//   and puts its newest one in #version when the version typed is not one of them.
"use strict";

(function () {
  document.addEventListener("submit", function (ev) {
    var form = ev.target;
    if (!(form instanceof HTMLFormElement) || !form.hasAttribute("data-reason")) return;
    var source = document.getElementById("action-reason");
    var field = form.querySelector("input[name=reason]");
    if (source && field) field.value = source.value;
  });

  function versions(select) {
    var list = document.getElementById("version-list");
    var input = document.getElementById("version");
    if (!list || !input) return;
    var all = Array.prototype.slice.call(list.querySelectorAll("option"));
    function offer() {
      var model = select.value;
      var mine = all.filter(function (o) { return o.getAttribute("data-model") === model; });
      list.replaceChildren.apply(list, mine);
      var known = mine.some(function (o) { return o.value === input.value; });
      if (!known && mine.length) input.value = mine[0].value;
    }
    select.addEventListener("change", offer);
    list.replaceChildren.apply(
      list, all.filter(function (o) { return o.getAttribute("data-model") === select.value; })
    );
  }

  document.addEventListener("DOMContentLoaded", function () {
    var select = document.getElementById("model");
    if (select && select.form && select.form.id === "rollout-form") versions(select);
  });
})();
