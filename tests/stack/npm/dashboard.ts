// What each part of a shipped dashboard is checked against (tests/stack/npm/schema.cjs):
// the dashboard types of @grafana/schema (the veneer types Grafana's frontend uses),
// with the parts @grafana/schema leaves open (`Record<string, unknown>`) filled in where
// Grafana publishes a type under Apache-2.0: a panel's options and custom field config
// from that panel plugin's own types in @grafana/schema, matcher ids and transformation
// options from @grafana/data. The ALLOWLIST section below holds what Grafana reads but
// publishes no Apache-2.0 type for; nothing else is accepted, except where Grafana's own
// types stay open (`unknown`, an index signature).
import type {
  Dashboard,
  DataQuery,
  FieldConfig,
  MatcherConfig,
  Panel,
  RowPanel,
  VariableModel,
} from "@grafana/schema";
import type { FieldMatcherID } from "@grafana/data/dist/types/transformations/matchers/ids";
import type { OrganizeFieldsTransformerOptions } from "@grafana/data/dist/types/transformations/transformers/organize";
import type { MergeTransformerOptions } from "@grafana/data/dist/types/transformations/transformers/merge";
import type * as bargauge from "@grafana/schema/dist/types/raw/composable/bargauge/panelcfg/x/types.gen";
import type * as heatmap from "@grafana/schema/dist/types/raw/composable/heatmap/panelcfg/x/types.gen";
import type * as stat from "@grafana/schema/dist/types/raw/composable/stat/panelcfg/x/types.gen";
import type * as table from "@grafana/schema/dist/types/raw/composable/table/panelcfg/x/types.gen";
import type * as timeseries from "@grafana/schema/dist/types/raw/composable/timeseries/panelcfg/x/types.gen";

// ---- ALLOWLIST: read by Grafana, typed by nothing Grafana publishes under Apache-2.0 ----

/** A Prometheus query: @grafana/schema types a panel's targets as open records and has
 * no Prometheus query type (Grafana's is in its AGPL Prometheus plugin, @grafana/prometheus).
 * Past DataQuery's fields, the ones the dashboards use, as the query editor saves them. */
interface PrometheusQuery extends DataQuery {
  expr: string;
  legendFormat?: string;
  instant?: boolean;
  range?: boolean;
  format?: "time_series" | "table" | "heatmap";
  exemplar?: boolean;
  editorMode?: "code" | "builder";
}

/** A Prometheus query variable's query (VariableModel.query is an open record; the
 * variable editor's type is in the same AGPL plugin). */
interface PrometheusVariableQuery {
  query: string;
  refId: string;
  qryType?: number;
}

/** `definition`: the query as text, which the variable editor saves and the variables list
 * shows; @grafana/data's QueryVariableModel has it, @grafana/schema's VariableModel not. */
type Variable = Omit<VariableModel, "query"> & { query?: string | PrometheusVariableQuery; definition?: string };

/** An alert list panel: @grafana/schema ships no panelcfg for it, so its options stay the
 * open record @grafana/schema's Panel declares. */
type AlertListOptions = Record<string, unknown>;

// ---- typed from Grafana's own packages ----------------------------------------------

/** Panel plugins without custom field config (no FieldConfig in their panelcfg). */
interface NoCustomFieldConfig {}

/** An override property: the id of a field config option ("unit", "custom.fillOpacity")
 * and a value of that option's type. */
type StandardField = Omit<FieldConfig, "custom">;
type Property<Custom> =
  | { [K in keyof StandardField]-?: { id: K; value?: StandardField[K] } }[keyof StandardField]
  | { [K in keyof Custom & string]-?: { id: `custom.${K}`; value?: Custom[K] } }[keyof Custom & string];

type FieldConfigSourceOf<Custom> = {
  defaults: StandardField & { custom?: Custom };
  overrides: Array<{ matcher: Omit<MatcherConfig, "id"> & { id: FieldMatcherID }; properties: Array<Property<Custom>> }>;
};

type Transformation = Omit<NonNullable<Panel["transformations"]>[number], "id" | "options"> &
  ({ id: "merge"; options: MergeTransformerOptions } | { id: "organize"; options: OrganizeFieldsTransformerOptions });

type PanelOf<Type extends string, Options, Custom> = Omit<Panel, "type" | "options" | "fieldConfig" | "targets" | "transformations"> & {
  type: Type;
  options?: Options;
  fieldConfig?: FieldConfigSourceOf<Custom>;
  targets?: PrometheusQuery[];
  transformations?: Transformation[];
};

type AnyPanel =
  | PanelOf<"timeseries", timeseries.Options, timeseries.FieldConfig>
  | PanelOf<"stat", stat.Options, NoCustomFieldConfig>
  | PanelOf<"bargauge", bargauge.Options, NoCustomFieldConfig>
  | PanelOf<"table", table.Options, table.FieldConfig>
  | PanelOf<"heatmap", heatmap.Options, heatmap.FieldConfig>
  | PanelOf<"alertlist", AlertListOptions, NoCustomFieldConfig>;

type Row = Omit<RowPanel, "panels"> & { panels: AnyPanel[] };

/** A dashboard file as the repository ships it. */
export type CheckedDashboard = Omit<Dashboard, "panels" | "templating"> & {
  panels?: Array<AnyPanel | Row>;
  templating?: { list?: Variable[] };
};
