/* The C side of the cpu backend's interface; build.py passes this text to cffi's cdef too. */
#define IG_Q4_0 2
#define IG_Q4_1 3
#define IG_Q5_0 6
#define IG_Q5_1 7
#define IG_Q8_0 8
#define IG_Q3_K 11
#define IG_Q4_K 12
#define IG_Q5_K 13
#define IG_Q6_K 14

/* A weight matrix [rows, cols] in one of the block types above, rows as stored. */
typedef struct {
    int type;
    int rows;
    int cols;
    int64_t row_bytes;
    const uint8_t *data;
    const uint8_t *tiles; /* the amx build: the copy in the tiles' layout (ig_amx_repack); NULL: none */
} ig_mat;

/* One activation block: x ~ d * q (q int16, d = amax / 32767), s = d * sum(q). */
typedef struct {
    float d;
    float s;
    int16_t q[32];
} ig_xblk;

typedef struct {
    ig_mat qkv[3];     /* q, k, v: outputs concatenated */
    ig_mat o;
    ig_mat gate_up[2]; /* gate, up */
    ig_mat down;
    const float *attn_norm;
    const float *mlp_norm;
    const float *qkv_bias; /* NULL: none */
    int window;            /* sliding window in tokens, 0: none */
} ig_layer;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, rot_dim, threads;
    float eps, attn_scale, embed_scale;
    ig_mat embed;
    ig_mat lm_head;
    const float *final_norm;
    ig_layer *layers;
    uint16_t *k_cache; /* IEEE half [layers, slots, kv_heads * head_dim] */
    uint16_t *v_cache;
    int64_t layer_stride; /* elements per layer of the cache */
} ig_model;

/* One forward: n rows. Row r feeds tokens[r] at positions[r], writes its K/V at
 * write_slots[r], and attends over ctx_slots[row_ctx_off[r] ...], row_ctx_n[r]
 * entries holding positions row_ctx_p0[r] ... (causal: entries past the row's own
 * position are not counted in row_ctx_n). cos/sin: [n, rot_dim]. */
typedef struct {
    int n;
    const int32_t *tokens;
    const int32_t *positions;
    const float *cos;
    const float *sin;
    const int64_t *write_slots;
    const int64_t *ctx_slots;
    const int32_t *row_ctx_off;
    const int32_t *row_ctx_n;
    const int32_t *row_ctx_p0;
    int tiled_rows; /* from this many rows on, products and attention use the tiled kernels (prefill); 0: never */
} ig_batch;

void ig_dequant(const ig_mat *w, int row0, int nrows, float *out);
void ig_quantize(const float *x, int nrows, int n, ig_xblk *out);
void ig_matmul(const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy, int threads);
/* The same product through the tiled (prefill) kernel whatever nx; the decode path without AVX2. */
void ig_matmul_tiled(const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy, int threads);
int ig_forward(const ig_model *m, const ig_batch *b, float *out_h);
int ig_logits(const ig_model *m, const float *h, int n, float *logits);
/* AMX tile products (the amx build): 0 once this process may use the tiles (asks the kernel
 * once, arch_prctl); -1 where the build has none or the kernel refuses. */
int ig_amx_init(void);
/* The amx build: decode products of at least ``rows`` rows go through the tiles, those below
 * through AVX2 block sums, all with the tiled (prefill) product's bits; 0: the other builds'
 * decode path and bits. Returns the previous value (3 at start); other builds ignore it. */
int ig_amx_rows(int rows);
/* The amx build: bytes of w's copy in the tile loads' layout (0: the tiles read w as stored, or
 * the build has no tiles), and that copy written to out (64-byte aligned); point w->tiles at it. */
int64_t ig_amx_repack_bytes(const ig_mat *w);
void ig_amx_repack(const ig_mat *w, uint8_t *out);
