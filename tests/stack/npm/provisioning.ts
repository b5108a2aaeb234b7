// The provisioning files' keys, transcribed from Grafana's documentation: Grafana
// publishes no machine-readable schema for them under Apache-2.0 (the Go types that read
// them are in its AGPL server, and they ignore unknown keys, so a misspelt key is lost
// silently). Sources, in Grafana's repository:
//   docs/sources/administration/provisioning/index.md (the files, the common jsonData table)
//   docs/sources/datasources/prometheus/configure/_index.md ("Provision the Prometheus data source")
//   docs/sources/datasources/tempo/configure-tempo-data-source/provision.md (the example file)
// Checked by tests/stack/npm/schema.cjs like the dashboards: unknown keys are refused.

/** jsonData keys the common table lists for every HTTP data source. */
interface HttpJsonData {
  tlsAuth?: boolean;
  tlsAuthWithCACert?: boolean;
  tlsSkipVerify?: boolean;
  serverName?: string;
  timeout?: string;
  keepCookies?: string[];
}

interface ExemplarTraceIdDestination {
  name: string;
  datasourceUid?: string;
  url?: string;
  /** The UI's "URL label" (the Prometheus page documents the field; its example leaves
   * the key out): the one key here named as Grafana's editor saves it, not from a doc. */
  urlDisplayLabel?: string;
}

/** The common table's Prometheus rows and the Prometheus page's example. */
interface PrometheusJsonData extends HttpJsonData {
  httpMethod?: "POST" | "GET";
  manageAlerts?: boolean;
  allowAsRecordingRulesTarget?: boolean;
  alertmanagerUid?: string;
  prometheusType?: "Prometheus" | "Cortex" | "Mimir" | "Thanos";
  prometheusVersion?: string;
  cacheLevel?: "Low" | "Medium" | "High" | "None";
  incrementalQuerying?: boolean; // the table says string; the Prometheus page, a toggle
  incrementalQueryOverlapWindow?: string;
  disableRecordingRules?: boolean;
  timeInterval?: string;
  customQueryParameters?: string;
  exemplarTraceIdDestinations?: ExemplarTraceIdDestination[];
  sigV4Auth?: boolean;
  sigV4AuthType?: string;
  sigV4ExternalId?: string;
  sigV4AssumeRoleArn?: string;
  sigV4Region?: string;
  sigV4Profile?: string;
}

interface Tag {
  key: string;
  value?: string;
}

interface TimeShifts {
  spanStartTimeShift?: string;
  spanEndTimeShift?: string;
}

/** The Tempo page's example file, block by block. */
interface TempoJsonData extends HttpJsonData {
  tracesToLogsV2?: TimeShifts & {
    datasourceUid: string;
    tags?: Tag[];
    filterByTraceID?: boolean;
    filterBySpanID?: boolean;
    customQuery?: boolean;
    query?: string;
  };
  tracesToMetrics?: TimeShifts & {
    datasourceUid: string;
    tags?: Tag[];
    queries?: Array<{ name: string; query: string }>;
  };
  tracesToProfiles?: {
    datasourceUid: string;
    tags?: Tag[];
    profileTypeId?: string;
    customQuery?: boolean;
    query?: string;
  };
  serviceMap?: { datasourceUid: string };
  nodeGraph?: { enabled: boolean };
  search?: { hide: boolean };
  traceQuery?: TimeShifts & { timeShiftEnabled?: boolean };
  spanBar?: { type: string; tag?: string };
  streamingEnabled?: { search?: boolean; metrics?: boolean };
}

/** A `datasources` entry: the provisioning page's example, key by key. */
interface DataSourceBase {
  name: string;
  access: "proxy" | "direct";
  orgId?: number;
  uid?: string;
  url?: string;
  user?: string;
  database?: string;
  basicAuth?: boolean;
  basicAuthUser?: string;
  withCredentials?: boolean;
  isDefault?: boolean;
  secureJsonData?: Record<string, string>;
  version?: number;
  editable?: boolean;
}

type DataSource =
  | (DataSourceBase & { type: "prometheus"; jsonData?: PrometheusJsonData })
  | (DataSourceBase & { type: "tempo"; jsonData?: TempoJsonData });

export interface DataSourcesFile {
  apiVersion: 1;
  deleteDatasources?: Array<{ name: string; orgId?: number }>;
  prune?: boolean;
  datasources?: DataSource[];
}

/** A dashboard provider: the provisioning page's example, key by key. */
interface DashboardProvider {
  name: string;
  orgId?: number;
  folder?: string;
  folderUid?: string;
  type?: "file";
  disableDeletion?: boolean;
  updateIntervalSeconds?: number;
  allowUiUpdates?: boolean;
  options: { path: string; foldersFromFilesStructure?: boolean };
}

export interface DashboardsFile {
  apiVersion: 1;
  providers: DashboardProvider[];
}
