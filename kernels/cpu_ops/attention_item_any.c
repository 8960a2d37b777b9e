/* Paged attention's items of head_dim other than 64 and 128 (attention_item.h; paged_attention.c
 * has the contract and the driver). A file of their own so they compile beside the others. */
#include "attention_item.h"

DEFINE_RUN_ITEM(run_item_any, A->D / 16)
